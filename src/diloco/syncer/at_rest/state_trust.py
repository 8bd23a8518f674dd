"""Whether a state on disk may be resumed: written by the holder of the state key, and not older than the newest
generation this syncer is known to have written. store.py reads the files; this module only decides.

**Signed.** A state written with a key is never resumed without one. The key file, its generation record (only a
syncer with a key writes one) and a signature in either manifest each show that the state was signed: with any of
them present and the key missing, the state is refused until the key is put back. A state with none of them
looks like one written before state keys existed; since whoever can write the folder can remove all of them, it
is resumed only on the operator's word (`--accept-unsigned`), and its next save signs it.

**Newest.** The generation reached is the highest of the signed record beside the key and the other manifest's
generation when its signature verifies. The manifest in use may not be older (`--state-recover` may take the
previous one, one behind). A signed state whose record is missing, unreadable or not signed cannot be checked, and
is refused like a rollback; `--accept-rollback` resumes either.

What this cannot do: it all rests on the key. Whoever can write the folder that holds the key and its record
(`--state DIR` by default) can put a key of their own in place and sign anything, or set aside a whole older copy,
record included, and put it back later. A key kept elsewhere (`--state-key FILE`) keeps its record there too, out
of their reach: then every forgery and every rollback is seen. Whoever can read the key can forge anything."""

from __future__ import annotations

from pathlib import Path


def keyless(manifest: Path, key_file: Path, traces: list[str], accept_unsigned: bool) -> str | None:
    """Why a state whose key file is missing cannot be resumed (`traces`: what shows it was signed), or None."""
    if traces:
        return (f"{manifest} belongs to a state written with a state key ({'; '.join(traces)}), but the key "
                f"{key_file} is missing: put back the key file the syncer created (or pass --state-key FILE where "
                f"it is kept), or move {manifest.parent} aside to start a new run (then restart the learners too); "
                f"a signed state is never resumed without its key")
    if accept_unsigned:
        return None
    return (f"{manifest} is not signed and there is no state key {key_file}: it was written before state keys "
            f"existed, or its key and signatures were removed; put the key back (or pass --state-key FILE where it "
            f"is kept), or, only if this state was written before state keys existed, pass --accept-unsigned to "
            f"resume it (its next save signs it)")


def rollback(folder: Path, generation: int, record: int | None, no_record: str | None, other: int | None,
             previous: bool) -> tuple[str, str] | None:
    """(what happened, how to put it right) when resuming `generation` may go back, None when it does not.

    `record`: the signed record's generation, or `no_record` saying why there is none; `other`: the other
    manifest's generation when its signature verifies; `previous`: `generation` is the previous manifest's, taken
    because the newest is damaged (a save replaces the newest after the previous is kept: at most one behind)."""
    reached = max((g for g in (record, other) if g is not None), default=None)
    if reached is not None and generation < reached - (1 if previous else 0):
        return (f"the state folder {folder} holds generation {generation} but this syncer last wrote {reached}: it "
                f"was rolled back (an older copy put in place, or an older manifest renamed)",
                "put the newest state back")
    if record is None:
        return (f"the state folder {folder} holds generation {generation}, but the record of the newest generation "
                f"this syncer wrote, {no_record}: the state may have been rolled back",
                "put the record and the newest state back")
    return None
