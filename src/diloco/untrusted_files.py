"""Reading a file someone else may have placed (the state folder, a checkpoint, a --config file) so that it can
neither crash nor stall the reader: a regular file only (a FIFO or a device is refused before a byte is read, and
opening one never blocks), at most a given size, and JSON or TOML nested at most MAX_DEPTH levels deep.

Files the syncer writes itself are read without following a symbolic link (it never makes one); files a person
names (--config, --credentials, a checkpoint) may be links, as long as they end at a regular file. A missing file
raises FileNotFoundError as usual: what absence means is the caller's to say."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

MAX_DEPTH = 64
"""Deepest nesting of JSON or TOML accepted: what diloco writes is under 8 levels; deeper is hostile."""


class UntrustedFileError(ValueError):
    """A file refused as it is: `path` and `why` (what was wrong, without the path)."""

    def __init__(self, path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = str(path), why


class TooLarge(UntrustedFileError):
    """The file holds more than the bytes allowed."""


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a folder" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a plain file")


def open_regular(path, follow_symlinks: bool = False) -> int:
    """A read-only descriptor of the regular file at `path` (close it); UntrustedFileError for anything else."""
    st = os.stat(path, follow_symlinks=follow_symlinks)  # refuse before opening: opening a device can act
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedFileError(path, "a symbolic link (refused: diloco never writes one here)")
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFileError(path, f"not a regular file ({_kind(st.st_mode)})")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:  # swapped for a link since the stat
            raise UntrustedFileError(path, "a symbolic link (refused: diloco never writes one here)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped since the stat
        os.close(fd)
        raise UntrustedFileError(path, f"not a regular file ({_kind(mode)})")
    return fd


def _size(limit: int) -> str:
    return f"{limit >> 20} MB" if limit >= 1 << 20 and not limit & ((1 << 20) - 1) else f"{limit} bytes"


def read_bytes(path, limit: int | None, follow_symlinks: bool = False) -> bytes:
    """The file's bytes; TooLarge past `limit` (None: any size, for a file whose size was checked elsewhere)."""
    with os.fdopen(open_regular(path, follow_symlinks), "rb") as f:
        if limit is None:
            return f.read()
        if os.fstat(f.fileno()).st_size > limit:
            raise TooLarge(path, f"larger than {_size(limit)}")
        data = f.read(limit + 1)  # it may have grown since the fstat
    if len(data) > limit:
        raise TooLarge(path, f"larger than {_size(limit)}")
    return data


def check_depth(value, path, limit: int = MAX_DEPTH):
    """`value` when its lists and dicts nest at most `limit` deep (counted without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            raise UntrustedFileError(path, f"nested deeper than {limit} levels")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def parse_json(data: bytes | str, path, **loads):
    """JSON from an untrusted file's bytes (`loads`: json.loads's hooks)."""
    try:
        value = json.loads(data, **loads)
    except RecursionError:  # the decoder's own guard, far deeper than MAX_DEPTH
        raise UntrustedFileError(path, f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a hook's refusal
        raise UntrustedFileError(path, f"not valid JSON ({e})") from None
    return check_depth(value, path) if isinstance(value, (dict, list)) else value


def read_json(path, limit: int, follow_symlinks: bool = False, **loads):
    return parse_json(read_bytes(path, limit, follow_symlinks), path, **loads)


def read_toml(path, limit: int, follow_symlinks: bool = True) -> dict:
    data = read_bytes(path, limit, follow_symlinks)
    try:
        value = tomllib.loads(data.decode("utf-8"))
    except RecursionError:
        raise UntrustedFileError(path, f"nested deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UntrustedFileError(path, f"not valid TOML ({e})") from None
    return check_depth(value, path)
