"""Giving freed memory back to the operating system.

Fragments are encoded and decoded a few MB at a time on the transport's threads. glibc keeps such blocks in
per-thread arenas after they are freed, so a learner's resident size would grow by about one model of freed
memory that nobody uses. After each large transfer the thread that made it asks glibc to return what is free.
"""

from __future__ import annotations

import ctypes
import ctypes.util

TRIM_AFTER_BYTES = 16 << 20
"""Transfers smaller than this leave too little behind to be worth a trim."""

_libc = None
try:
    _name = ctypes.util.find_library("c")
    _libc = ctypes.CDLL(_name) if _name else None
    if _libc is not None and not hasattr(_libc, "malloc_trim"):
        _libc = None  # not glibc (musl, macOS): their allocators return memory by themselves or not at all
except OSError:
    _libc = None


def release_after(nbytes: int) -> None:
    """Return free heap memory to the OS after a transfer of `nbytes` (a no-op off glibc)."""
    if _libc is not None and nbytes >= TRIM_AFTER_BYTES:
        _libc.malloc_trim(0)
