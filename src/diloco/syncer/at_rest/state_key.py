"""The syncer's state key: 32 random bytes in a 0600 file beside the state folder (`DIR/state.key` for
`--state DIR`, or `--state-key FILE`), created before the first manifest. Every manifest carries an HMAC-SHA256 of
its contents under it, and the manifest names each file's SHA-256 (the ledger holds the configuration), so whoever
can write the state folder but not read the key cannot make a state the syncer accepts: recomputed hashes, a
swapped file or an edited configuration are refused. Beside the key, its generation record
(`<key without .key>.generation`) holds the highest generation this syncer wrote, signed too, so an older state
put back in place (a rolled-back copy, the previous manifest renamed) is told apart from the newest one
(state_trust.py decides what to do with both)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
from pathlib import Path

from diloco import untrusted_files
from diloco.atomic import write_bytes

KEY_BYTES = 32
log = logging.getLogger("diloco.syncer")
DOMAIN = b"diloco-syncer-manifest-v1\0"
RECORD_DOMAIN = b"diloco-syncer-generation-v1\0"
"""Prefixed to what is signed: a manifest's signature is never a valid record's, nor the other way round."""


class BadKey(ValueError):
    """The key file exists but is not a key (the message names it and what to do)."""


class NoRecord(Exception):
    """The generation record at `path` cannot be used, and `why`: missing, unreadable or not signed with the key."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path} {why}")
        self.path, self.why = path, why


def canonical(manifest: dict) -> bytes:
    """The signed bytes: the manifest without its signature, keys sorted, no spaces."""
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    return DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class StateKey:
    """The key file at `path` and its companion `<path without .key>.generation`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.generation_path = self.path.with_suffix(".generation")
        self._key: bytes | None = None

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def key(self, create: bool = False) -> bytes | None:
        """The key; None when there is no key file (created when `create`)."""
        if self._key is None:
            try:  # a link is followed (a mounted secret), but only to a regular file
                data = untrusted_files.read_bytes(self.path, KEY_BYTES, follow_symlinks=True)
            except FileNotFoundError:
                if not create:
                    return None
                data = os.urandom(KEY_BYTES)
                write_bytes(self.path, data)  # 0600, atomic
            except untrusted_files.UntrustedFileError as e:
                raise BadKey(f"the state key {self.path} is {e.why}, not a {KEY_BYTES}-byte key file: restore it from "
                             f"where it was kept (the state is signed with it)") from None
            if len(data) != KEY_BYTES:
                raise BadKey(f"the state key {self.path} holds {len(data)} bytes, not {KEY_BYTES}: restore it "
                             f"from where it was kept (the state is signed with it)")
            mode = stat.S_IMODE(os.stat(self.path).st_mode)
            if mode & 0o077:  # copied in with a wider mode: whoever could read it can forge the state
                os.chmod(self.path, mode & 0o700)
                log.warning("the state key %s was readable by group or others (mode %o): tightened to %o; if others "
                            "could read it, they can forge the state", self.path, mode, mode & 0o700)
            self._key = data
        return self._key

    def sign(self, manifest: dict) -> dict:
        """`manifest` with its signature (`hmac`), creating the key on first use."""
        mac = hmac.new(self.key(create=True), canonical(manifest), hashlib.sha256).hexdigest()
        return {**{k: v for k, v in manifest.items() if k != "hmac"}, "hmac": mac}

    def verifies(self, manifest: dict) -> bool:
        given = manifest.get("hmac")
        key = self.key()
        if not isinstance(given, str) or key is None:
            return False
        return hmac.compare_digest(given, hmac.new(key, canonical(manifest), hashlib.sha256).hexdigest())

    @property
    def traces(self) -> list[Path]:
        """Those of the key file and its record that are there (even as something unreadable): only a syncer that
        had a key wrote them."""
        return [p for p in (self.path, self.generation_path) if os.path.lexists(p)]

    @staticmethod
    def _record_mac(key: bytes, generation: int) -> str:
        return hmac.new(key, RECORD_DOMAIN + str(generation).encode(), hashlib.sha256).hexdigest()

    def last_generation(self) -> int:
        """The highest generation this syncer recorded. Raises NoRecord when the record is missing, unreadable or
        not signed with the key: deleting or rewriting it must not pass for a state with nothing to check."""
        try:
            record = untrusted_files.read_json(self.generation_path, 4096)
        except FileNotFoundError:
            raise NoRecord(self.generation_path, "is missing") from None
        except (ValueError, OSError) as e:
            raise NoRecord(self.generation_path, f"is unreadable ({getattr(e, 'why', e)})") from None
        value = record.get("generation") if isinstance(record, dict) else None
        given = record.get("hmac") if isinstance(record, dict) else None
        key = self.key()
        if (key is None or not isinstance(value, int) or isinstance(value, bool) or not isinstance(given, str)
                or not hmac.compare_digest(given, self._record_mac(key, value))):
            raise NoRecord(self.generation_path, f"is not signed with the state key {self.path}")
        return value

    def remember(self, generation: int) -> None:
        mac = self._record_mac(self.key(create=True), generation)
        write_bytes(self.generation_path, json.dumps({"generation": generation, "hmac": mac}).encode())
