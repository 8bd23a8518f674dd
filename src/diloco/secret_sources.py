"""Where the commands' secrets come from. A command line is readable by every local user (`ps`) and a config file
is shared; so every secret flag has two other sources, and the rule the docs give is: secrets in the environment or
in a file only their owner reads, never on a command line or in a config file.

    --token VALUE        the value itself (kept for loopback and tests)
    --token-file FILE    a file holding only the secret (trailing newline ignored), e.g. a mounted Kubernetes secret
    DILOCO_TOKEN         the environment, when neither flag is given

The file is read as untrusted (a regular file of at most MAX_BYTES, never a FIFO that would block), and a file that
others may read is used with a warning that says how to fix it."""

from __future__ import annotations

import logging
import os
import stat

from diloco.options import UserError
from diloco.untrusted_files import UntrustedFileError, read_bytes

log = logging.getLogger("diloco.secrets")

MAX_BYTES = 4096
"""Largest secret file read: a token is tens of bytes."""

SOURCES = {"token": ("DILOCO_TOKEN",), "status_token": ("DILOCO_STATUS_TOKEN",)}
"""Each secret flag's destination, and the environment variables it falls back on, in order."""
READER_SOURCES = {"token": ("DILOCO_STATUS_TOKEN", "DILOCO_TOKEN")}
"""`diloco status`: its --token is a status token, or the run's."""


def read_secret(flag: str, path) -> str:
    """The secret in `path` (what `flag` names), stripped of surrounding whitespace; UserError when it cannot be
    one."""
    try:
        data = read_bytes(path, MAX_BYTES, follow_symlinks=True)  # mounted secrets are links
        mode = os.stat(path).st_mode
    except (UntrustedFileError, OSError) as e:
        raise UserError(f"{flag}: cannot read the secret: {e}") from None
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{flag}: {path} is not UTF-8 text; it must hold the secret alone") from None
    if not secret or any(c.isspace() for c in secret):
        raise UserError(f"{flag}: {path} must hold the secret alone, on one line "
                        f"({'it is empty' if not secret else 'it holds whitespace inside'})")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: %s can be read by other users (mode %o): chmod 600 %s", flag, path, stat.S_IMODE(mode), path)
    return secret


def resolve(args, environ=os.environ) -> None:
    """Set each secret of `args` (a command's parsed flags) from its flag, its file or the environment, in that
    order of precedence; a flag and its file together are a mistake."""
    sources = READER_SOURCES if getattr(args, "command", None) == "status" else SOURCES
    for dest, variables in sources.items():
        if not hasattr(args, dest):
            continue
        flag = "--" + dest.replace("_", "-")
        path = getattr(args, f"{dest}_file", None)
        if path is not None and getattr(args, dest):
            raise UserError(f"{flag} and {flag}-file both give the secret: keep one (the file keeps it out of `ps`)")
        if path is not None:
            setattr(args, dest, read_secret(f"{flag}-file", path))
        elif not getattr(args, dest):
            setattr(args, dest, next((environ[v].strip() for v in variables if environ.get(v, "").strip()), None))


def add_file_flag(group, dest: str, what: str) -> None:
    """`--DEST-file FILE` beside the secret flag `--DEST`, on an argparse group."""
    flag = "--" + dest.replace("_", "-")
    group.add_argument(f"{flag}-file", metavar="FILE", help=(
        f"a file holding {what} alone, readable only by you: keeps it off the command line (else {flag}, else "
        f"${SOURCES[dest][0]})"))
