"""Per-learner credentials: a file naming each learner id with the SHA-256 of its own token.

    # diloco credentials (`diloco credentials new ID --file FILE` adds one); never the tokens themselves
    [learners.site-b]
    token_sha256 = "3b7a…"          # 64 hex digits

A learner proves its id with its own token (`diloco learner --id site-b --token …`), so nobody else can take its id
before it starts or after it crashes, and it reclaims its id with the same token after a restart. Each credential
names one id, and no two ids share a digest: one party cannot multiply itself. A run-wide shared token (`--token`)
remains for trusted setups, and never beside a credentials file: there any holder may join under any id that is not
live.

The syncer reads the file again when it changes and on SIGHUP (syncer/defences/credentials_watch.py): an id removed from it,
or given a new token, is revoked at once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from diloco import untrusted_files
from diloco.ids import LEARNER_ID

DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_BYTES = 16 << 20
"""Largest credentials file read (about 150 000 learners)."""


class CredentialsError(ValueError):
    """The credentials file is unreadable or malformed; the message names the file and the entry."""


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def proof(token_sha256: str) -> str:
    """What a learner's record keeps of the credential its session was opened with (saved in the state folder): a
    token replaced in the file revokes the sessions opened with the old one, across a restart too."""
    return hashlib.sha256(b"diloco-credential\0" + token_sha256.encode()).hexdigest()[:32]


class Credentials:
    """The learner ids a syncer admits, each with the SHA-256 of its token."""

    def __init__(self, digests: dict[str, str], path: Path | None = None):
        self.digests, self.path = digests, path

    @classmethod
    def load(cls, path: Path) -> "Credentials":
        try:
            data = untrusted_files.read_toml(path, MAX_BYTES)
        except untrusted_files.UntrustedFileError as e:
            raise CredentialsError(f"--credentials {path}: {e.why}") from None
        except OSError as e:
            raise CredentialsError(f"--credentials {path}: cannot read it ({e.strerror})") from None
        unknown = set(data) - {"learners"}
        if unknown:
            raise CredentialsError(f"--credentials {path}: unknown key(s) {', '.join(sorted(unknown))}; the file holds "
                                   f"[learners.<id>] tables only")
        learners = data.get("learners", {})
        if not isinstance(learners, dict) or not learners:
            raise CredentialsError(f"--credentials {path}: no [learners.<id>] entry; add one with "
                                   f"`diloco credentials new ID --file {path}`")
        digests, holders = {}, {}
        for learner_id, entry in learners.items():
            if not LEARNER_ID.fullmatch(learner_id):
                raise CredentialsError(f"--credentials {path}: {learner_id!r} is not a valid learner id (1-64 letters, "
                                       f"digits, '.', '_' or '-', starting with a letter or digit)")
            value = entry.get("token_sha256") if isinstance(entry, dict) else None
            if not isinstance(value, str) or not DIGEST.fullmatch(value):
                raise CredentialsError(f"--credentials {path}: [learners.{learner_id}] needs token_sha256 = 64 "
                                       f"lower-case hex digits (the SHA-256 of its token, never the token)")
            if set(entry) - {"token_sha256"}:
                raise CredentialsError(f"--credentials {path}: [learners.{learner_id}] has unknown key(s) "
                                       f"{', '.join(sorted(set(entry) - {'token_sha256'}))}")
            if value in holders:  # one token would prove both ids: one party posing as two
                raise CredentialsError(f"--credentials {path}: [learners.{holders[value]}] and [learners.{learner_id}] "
                                       f"have the same token_sha256; each learner needs its own token (`diloco "
                                       f"credentials new ID --file {path}` makes a new one)")
            digests[learner_id], holders[value] = value, learner_id
        return cls(digests, Path(path))

    def check(self, learner_id: str, token: str) -> bool:
        """Whether `token` is `learner_id`'s own token (constant time whether or not the id is listed)."""
        expected = self.digests.get(learner_id, "0" * 64)
        return hmac.compare_digest(expected, digest(token)) and learner_id in self.digests

    def proof(self, learner_id: str) -> str:
        """`proof` of `learner_id`'s current digest ("" when it is not listed)."""
        value = self.digests.get(learner_id)
        return proof(value) if value else ""

    def vouches(self, credential: str, proven: str) -> bool:
        """Whether a session opened with credential `credential` still stands: the id is listed and, when the
        session's `proven` is known (ledgers saved before it was kept have none), with the same token."""
        return credential in self.digests and (not proven or hmac.compare_digest(proven, self.proof(credential)))


def add(path: Path, learner_id: str) -> str:
    """A new token for `learner_id`, its digest written to the file at `path` (created 0600, or rewritten with
    the entry replaced); returns the token, which is stored nowhere."""
    if not LEARNER_ID.fullmatch(learner_id):
        raise CredentialsError(f"{learner_id!r} is not a valid learner id (1-64 letters, digits, '.', '_' or '-', "
                               f"starting with a letter or digit)")
    path = Path(path)
    digests = Credentials.load(path).digests if path.exists() else {}
    token = secrets.token_urlsafe(32)
    digests[learner_id] = digest(token)
    lines = ["# diloco credentials: each learner id with the SHA-256 of its own token (never the token)", ""]
    for lid, value in sorted(digests.items()):
        lines += [f'[learners."{lid}"]', f'token_sha256 = "{value}"', ""]
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return token
