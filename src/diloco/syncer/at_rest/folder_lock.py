"""One syncer per state folder: an exclusive lock on `DIR/syncer.lock`, taken before anything in DIR is read or
written and held for the syncer's whole life. Two syncers on one folder would overwrite each other's state.

The lock is the kernel's (flock), not the file's existence: it goes when its process ends, however it ends
(SIGKILL included), so a lock is never stale and the file is never removed. The file's text (the holder's pid and
gRPC address) only names the holder in the refusal."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path

from diloco import untrusted_files

LOCK_FILE = "syncer.lock"


class FolderInUse(OSError):
    """Another live syncer holds the state folder (exit code 75: it may be one still shutting down)."""


class FolderLock:
    def __init__(self, folder: Path, address: str):
        self.path = Path(folder) / LOCK_FILE
        try:  # O_NONBLOCK and the fstat: a FIFO or a device put there is refused, never waited on
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(f"{self.path} is a symbolic link: remove it (the syncer makes this file itself)") \
                    from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{self.path} is not a regular file: remove it (the syncer makes this file itself)")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUse(f"the state folder {folder} is in use by another syncer ({self._holder()}): stop that "
                              f"one first, or give this syncer a --state folder of its own") from None
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.describe(address)

    def describe(self, address: str) -> None:
        """Name this process and its gRPC address in the file (once the port is known: port 0 picks one)."""
        data = json.dumps({"pid": os.getpid(), "address": address}).encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))

    def _holder(self) -> str:
        try:
            holder = untrusted_files.read_json(self.path, 4096)
            return f"pid {int(holder['pid'])}, gRPC address {str(holder['address'])[:200]}"
        except (OSError, ValueError, KeyError, TypeError):  # being written, or not ours: the lock still holds
            return "its pid and address are not written yet"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
