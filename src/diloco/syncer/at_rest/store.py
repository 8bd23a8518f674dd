"""The syncer's durable state (docs/algorithm.md §8): a manifest naming one consistent set of files.

Every write goes to a temporary file, is fsynced and renamed; the manifest is replaced last, so a crash at any
point leaves the previous manifest and every file it names intact. The manifest records each file's size and
SHA-256; a load verifies them (and that every name stays inside the folder) before trusting a byte. The previous
generation is kept as well (`manifest.prev.json` and the files it names) until a newer one is fully written, so a
damaged newest generation can be recovered from (`StateStore(recover=True)`, the syncer's `--state-recover`).

Each manifest is signed with the syncer's state key, kept outside the folder (state_key.py): a state rewritten by
anyone without the key is refused, a signed state is never resumed without its key, and one older than the newest
this syncer wrote is refused as rolled back unless `accept_rollback` (`--accept-rollback`); state_trust.py says
how. The folder is 0700 and every file in it 0600.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load as load_safetensors

from diloco import untrusted_files
from diloco.atomic import Chunked, fsync_dir, private_folder, private_opener, save_tensor_stream, write_bytes, write_json
from diloco.algorithm.codec import all_finite
from diloco.syncer.at_rest import state_trust
from diloco.syncer.at_rest.state_key import BadKey, NoRecord, StateKey
from diloco.syncer.observation.throttle import Throttled

MANIFEST = "manifest.json"
PREVIOUS = "manifest.prev.json"
ROUND_LOG = "rounds.jsonl"
OWNED = re.compile(r"^(fragment-\d+-v\d+\.safetensors|ledger-\d+\.json)(\.tmp)?$")
"""Names of the files the store writes (and may delete): nothing else in the folder is ever removed."""
FRAGMENT = re.compile(r"^fragment-(\d+)-v(\d+)\.safetensors$")
MAX_MANIFEST = 16 << 20
MAX_LEDGER = 1 << 30
"""Largest manifest and ledger read (both are far smaller: a ledger holds a few KB per learner)."""
ROUNDS_TAIL = 128
"""Bytes read per round line asked for (a line is under 64): only the end of rounds.jsonl is read (it grows for
the whole run)."""

log = logging.getLogger("diloco.syncer")


class StateError(ValueError):
    """The state directory cannot be resumed from; the message names the file and what to do."""


class Damaged(Exception):
    """One file of a generation fails a check: `name` (inside the folder) and why."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name}: {why}")
        self.name, self.why = name, why


@dataclass
class Loaded:
    ledger: dict
    fragments: dict[int, dict[str, torch.Tensor]]
    generation: int = 0
    files: dict[str, str] = field(default_factory=dict)


def fragment_version(name: str) -> tuple[int, int] | None:
    """(index, version) from a fragment file's name, None when it is not one."""
    m = FRAGMENT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def safe_name(name) -> bool:
    """A plain file name inside the folder: no separator, no `..`, not absolute, not empty."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and os.sep not in name and (os.altsep is None or os.altsep not in name) and "\0" not in name
            and not os.path.isabs(name))


def save_fragment(path: Path, tensors: dict[str, torch.Tensor | Chunked]) -> tuple[int, str]:
    """One fragment's file; a `Chunked` tensor (Θ as P + residual) is written a piece at a time, never whole."""
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    return save_tensor_stream(path, layout, tensors.values())


def key_path(folder: Path) -> Path:
    """Where a state folder's key is kept by default: beside it (`DIR/state.key` for `DIR/state`), not in it."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".key")


class StateStore:
    """Files under `folder`: manifest.json, manifest.prev.json, ledger-<n>.json, fragment-<p>-v<version>.safetensors;
    beside it the state key and the highest generation written (`key`, default `key_path(folder)`)."""

    def __init__(self, folder: Path, recover: bool = False, key: Path | None = None, accept_rollback: bool = False,
                 accept_unsigned: bool = False):
        self.folder = Path(folder)
        private_folder(self.folder, log)
        self.recover, self.accept_rollback, self.accept_unsigned = recover, accept_rollback, accept_unsigned
        self.key = StateKey(key if key is not None else key_path(self.folder))
        self.recorded = False
        """The key's generation record is signed and not above the generation on disk: the next save needs not
        write it before its manifest."""
        self.errors = Throttled(log)
        """Write failures, logged once per interval with a count: a full disk fails every round."""
        self.generation = 0
        self.files: dict[str, str] = {}
        self.integrity: dict[str, list] = {}
        """{name: [size, sha256]} of the files the current manifest names."""
        try:  # leniently: load() verifies; a save without a load builds on what the manifest names
            manifest = self._read_manifest(MANIFEST)
            if manifest is not None:
                self.generation, self.files = manifest["generation"], manifest["files"]
                self.integrity = manifest.get("integrity", {})
        except (Damaged, StateError):
            pass

    @property
    def exists(self) -> bool:
        return bool(self.files)

    def _manifest(self) -> dict:
        return {"generation": self.generation, "files": dict(self.files), "integrity": dict(self.integrity)}

    def save(self, ledger: dict, fragments: dict[int, tuple[int, dict[str, torch.Tensor | Chunked]]]) -> None:
        """Write the ledger and the given fragments ({index: (version, tensors)}; a `Chunked` one is made as it is
        written), then switch the manifest. Raises OSError (naming the path) when the folder
        cannot take them; the current state is then unchanged."""
        generation = self.generation + 1
        files, integrity = dict(self.files), dict(self.integrity)
        for index, (version, tensors) in fragments.items():
            name = f"fragment-{index}-v{version}.safetensors"
            integrity[name] = list(save_fragment(self.folder / name, tensors))
            files[f"fragment-{index}"] = name
        ledger_name = f"ledger-{generation}.json"
        integrity[ledger_name] = list(write_json(self.folder / ledger_name, ledger))
        files["ledger"] = ledger_name
        integrity = {name: integrity[name] for name in files.values() if name in integrity}
        fsync_dir(self.folder)
        if not self.recorded:  # so that no signed manifest is ever on disk without a record at most its generation
            self.key.remember(self.generation)
            self.recorded = True
        previous = self._manifest()
        if self.files:  # the generation being replaced stays loadable until the next one is fully written
            write_json(self.folder / PREVIOUS, self.key.sign(previous))
        write_json(self.folder / MANIFEST, self.key.sign({"generation": generation, "files": files,
                                                         "integrity": integrity}))
        fsync_dir(self.folder)
        self.generation, self.files, self.integrity = generation, files, integrity
        # after the manifest is durable: a crash before this leaves a remembered generation one lower (accepted)
        self.recorded = False
        self.key.remember(generation)
        self.recorded = True
        keep = set(files.values()) | set(previous["files"].values())
        for path in self.folder.iterdir():  # superseded generations, and what a failed write left behind
            if OWNED.match(path.name) and path.name not in keep and not path.is_symlink() and path.is_file():
                try:
                    path.unlink(missing_ok=True)
                except OSError as e:  # the new state is in place: a file left over is only wasted space
                    log.warning("cannot remove the superseded %s: [Errno %s] %s", path, e.errno, e.strerror)

    def append_round(self, entry: tuple) -> None:
        """One line per closed round, appended (not fsynced): the history behind uptime, not needed to resume.
        A full or read-only disk loses the line (logged), never the round."""
        try:
            with open(self.folder / ROUND_LOG, "a", opener=private_opener) as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            self.errors.error("rounds", f"cannot append to {self.folder / ROUND_LOG}: [Errno {e.errno}] {e.strerror}")

    def rounds(self, last: int) -> list[tuple]:
        """The last `last` rounds of the history; a line cut by a crash is skipped."""
        path = self.folder / ROUND_LOG
        try:
            with os.fdopen(untrusted_files.open_regular(path), "rb") as f:
                start = max(0, os.fstat(f.fileno()).st_size - last * ROUNDS_TAIL)
                f.seek(start)
                lines = f.read(last * ROUNDS_TAIL).decode(errors="replace").splitlines()[1 if start else 0:]
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:  # only the history behind uptime: not worth refusing the state for
            log.warning("the round history %s is not used: %s", path, getattr(e, "why", e))
            return []
        out = []
        for line in lines[-last:]:
            try:
                entry = untrusted_files.parse_json(line, path)
            except ValueError:
                continue
            if isinstance(entry, list):
                out.append(tuple(entry))
        return out

    def rewrite_rounds(self, entries: list[tuple]) -> None:
        write_bytes(self.folder / ROUND_LOG, "".join(json.dumps(list(e)) + "\n" for e in entries).encode())

    # ---- loading --------------------------------------------------------------------------------------------
    def _read_manifest(self, name: str) -> dict | None:
        try:
            manifest = untrusted_files.read_json(self.folder / name, MAX_MANIFEST)
        except FileNotFoundError:
            return None
        except untrusted_files.UntrustedFileError as e:
            raise Damaged(name, e.why) from None
        except OSError as e:
            raise Damaged(name, f"unreadable ({e})") from None
        if (not isinstance(manifest, dict) or not isinstance(manifest.get("generation"), int)
                or not isinstance(manifest.get("files"), dict) or "ledger" not in manifest["files"]
                or not isinstance(manifest.get("integrity", {}), dict)):
            raise Damaged(name, "not a manifest (generation, files with a ledger, integrity)")
        for fname, entry in manifest.get("integrity", {}).items():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                    and isinstance(entry[1], str)):
                raise Damaged(name, f"records {entry!r} for {fname!r}, not [size, sha256]")
        for key, fname in manifest["files"].items():
            if not safe_name(fname):
                raise Damaged(name, f"names {fname!r} for {key!r}, which is not a plain file name inside the state "
                                    f"directory (refused: nothing outside it is read or deleted)")
            if key != "ledger" and (not key.startswith("fragment-") or fragment_version(fname) is None
                                    or f"fragment-{fragment_version(fname)[0]}" != key):
                raise Damaged(name, f"names {fname!r} for {key!r}, which is not that fragment's file")
        self._check_signature(name, manifest)
        return manifest

    def _check_signature(self, name: str, manifest: dict) -> None:
        """The manifest was written by the holder of the state key: its files' hashes, hence every byte of the
        state (the configuration in the ledger included), and its generation are the syncer's own."""
        try:
            key = self.key.key()
        except BadKey as e:
            raise StateError(str(e)) from None
        if key is None:
            refusal = state_trust.keyless(self.folder / name, self.key.path, self._traces(), self.accept_unsigned)
            if refusal:
                raise StateError(refusal)
            return  # written before state keys existed, resumed on the operator's word: the first save signs it
        if "hmac" not in manifest:
            raise Damaged(name, f"not signed, though every manifest this syncer writes is signed with its key "
                                f"{self.key.path}: it was written by something else")
        if not self.key.verifies(manifest):
            raise Damaged(name, f"its signature does not match the state key {self.key.path}: the state was changed "
                                f"outside the syncer (files replaced or edited, hashes recomputed), or the key is "
                                f"another state folder's")

    def _traces(self) -> list[str]:
        """What shows that the state was written with a key: signed manifests, the key file or its record."""
        signed = []
        for name in (MANIFEST, PREVIOUS):
            try:  # as they are: their contents are checked where they are used
                manifest = untrusted_files.read_json(self.folder / name, MAX_MANIFEST)
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict) and "hmac" in manifest:
                signed.append(f"{name} is signed")
        return signed + [f"{path} exists" for path in self.key.traces]

    def _check_rollback(self, generation: int, previous: bool) -> None:
        """Refuse `generation` when it may be older than the newest this syncer wrote (state_trust.rollback),
        unless `accept_rollback`; `previous`: it is the previous manifest's, taken by --state-recover."""
        self.recorded = False
        if self.key.key() is None:
            return  # an unsigned state resumed on the operator's word: there is nothing to hold it to
        record, no_record = None, None
        try:
            record = self.key.last_generation()
        except NoRecord as e:
            no_record = f"{e.path}, {e.why}"
        other = None
        if not previous:  # the previous manifest, when genuine, is evidence of how far the state got
            try:
                other = self._read_manifest(PREVIOUS)
            except (Damaged, StateError):
                other = None
        refusal = state_trust.rollback(self.folder, generation, record, no_record,
                                       other["generation"] if other else None, previous)
        if refusal is None:
            self.recorded = record <= generation
            return
        what, fix = refusal
        if not self.accept_rollback:
            raise StateError(f"{what}; {fix}, or pass --accept-rollback to resume from it (rounds after it are lost, "
                             f"learners resynchronise)")
        log.warning("%s; resuming from it (--accept-rollback)", what)

    def _read_file(self, manifest: dict, name: str, limit: int | None = None) -> bytes:
        """The bytes of a file of the generation, at most the size its manifest records (else `limit`)."""
        expected = manifest.get("integrity", {}).get(name)
        try:
            data = untrusted_files.read_bytes(self.folder / name, limit if expected is None else expected[0])
        except FileNotFoundError:
            raise Damaged(name, "missing") from None
        except untrusted_files.TooLarge:
            raise Damaged(name, f"size mismatch: larger than the {expected[0]} bytes the manifest recorded"
                          if expected is not None else f"larger than {limit} bytes") from None
        except untrusted_files.UntrustedFileError as e:
            raise Damaged(name, e.why) from None
        except OSError as e:
            raise Damaged(name, f"unreadable ({e.strerror or e})") from None
        if expected is not None:
            size, digest = expected
            if len(data) != size:
                raise Damaged(name, f"size mismatch: {len(data)} bytes, the manifest recorded {size}")
            if hashlib.sha256(data).hexdigest() != digest:
                raise Damaged(name, "hash mismatch: its SHA-256 is not the one the manifest recorded")
        return data

    def _load_generation(self, manifest: dict, check: Callable[[Loaded], None] | None) -> Loaded:
        if "integrity" not in manifest:
            log.warning("%s was written by an older version without hashes: its files are not verified",
                        self.folder / MANIFEST)
        if "hmac" not in manifest:
            log.warning("%s was written before state keys existed: resumed unauthenticated (--accept-unsigned); the "
                        "next save signs it with a new key in %s", self.folder / MANIFEST, self.key.path)
        files = manifest["files"]
        try:
            ledger = untrusted_files.parse_json(self._read_file(manifest, files["ledger"], MAX_LEDGER), files["ledger"])
        except untrusted_files.UntrustedFileError as e:
            raise Damaged(files["ledger"], e.why) from None
        if not isinstance(ledger, dict):
            raise Damaged(files["ledger"], "not a ledger (a JSON object)")
        fragments = {}
        for key, name in files.items():
            if key == "ledger":
                continue
            try:
                tensors = load_safetensors(self._read_file(manifest, name))
            except Damaged:
                raise
            except Exception as e:  # noqa: BLE001 (safetensors' own error type)
                raise Damaged(name, f"not a readable safetensors file ({e})") from None
            for tname, t in tensors.items():
                if t.is_floating_point() and not all_finite(t):
                    raise Damaged(name, f"tensor {tname!r} contains NaN or Inf")
            fragments[int(key.split("-")[1])] = tensors
        loaded = Loaded(ledger, fragments, manifest["generation"], dict(files))
        if check is not None:
            try:
                check(loaded)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
                raise Damaged(files["ledger"], f"not a consistent ledger ({type(e).__name__}: {e})") from None
        return loaded

    def _damaged(self, e: Damaged, generation: int | None) -> str:
        where = f"generation {generation}" if generation is not None else "the newest state"
        return f"{self.folder / e.name} is damaged ({e.why}) in {where}"

    def _previous_offer(self, newest: int | None) -> str:
        if (self.folder / PREVIOUS).exists():
            try:
                gen = self._read_manifest(PREVIOUS)["generation"]
            except (Damaged, StateError):
                gen = None
            return (f"start with --state-recover to resume from the previous consistent state"
                    f"{f' (generation {gen})' if gen is not None else ''}; rounds after it are lost, learners "
                    f"resynchronise")
        return (f"no previous consistent state is kept: restore the file from a backup, or move {self.folder} "
                f"aside to start a new run (then restart the learners too)")

    def load(self, check: Callable[[Loaded], None] | None = None) -> Loaded | None:
        """The newest consistent state, or None when nothing was ever saved. Every file is verified (inside the
        folder, size and SHA-256, finite tensors) and then `check(loaded)` (which raises Damaged) runs; a failure
        raises StateError naming the file, or with `recover` falls back to the previous generation."""
        names = [p.name for p in self.folder.iterdir()]
        manifest = None
        try:
            manifest = self._read_manifest(MANIFEST)
            if manifest is None:
                if PREVIOUS in names:
                    raise Damaged(MANIFEST, "missing, though manifest.prev.json is there")
                if any(OWNED.match(n) for n in names):
                    raise StateError(
                        f"state directory {self.folder} has fragment files but no manifest: {MANIFEST} was deleted "
                        f"or the directory was copied in part; restore {MANIFEST} from a backup, or move "
                        f"{self.folder} aside to start a new run (then restart the learners too)")
                return None
            self._check_rollback(manifest["generation"], previous=False)
            loaded = self._load_generation(manifest, check)
            self._adopt(manifest)
            return loaded
        except Damaged as e:
            gen = manifest["generation"] if manifest is not None else None
            newest_error = self._damaged(e, gen)
            if not self.recover:
                raise StateError(f"{newest_error}; {self._previous_offer(gen)}") from None
        log.error("%s; --state-recover: trying the previous consistent state", newest_error)
        try:
            previous = self._read_manifest(PREVIOUS)
            if previous is None:
                raise Damaged(PREVIOUS, "missing: no previous consistent state is kept")
            self._check_rollback(previous["generation"], previous=True)
            loaded = self._load_generation(previous, check)
        except Damaged as e:
            raise StateError(f"{newest_error}; the previous state is damaged too: {self._damaged(e, None)}; move "
                             f"{self.folder} aside to start a new run (then restart the learners too)") from None
        log.warning("recovered from the previous consistent state in %s (generation %d)", self.folder,
                    previous["generation"])
        self._adopt(previous)
        return loaded

    def _adopt(self, manifest: dict) -> None:
        """Saves go on from this generation (after a recovery: the damaged one is overwritten and removed)."""
        self.generation, self.files = manifest["generation"], dict(manifest["files"])
        self.integrity = dict(manifest.get("integrity", {}))
