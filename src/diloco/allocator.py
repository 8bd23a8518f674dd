"""glibc's malloc arenas: at most ARENAS in a syncer process, so memory freed by one thread is reused by the others.

glibc gives each thread that allocates while another holds an arena a new arena, up to 8 per core, and keeps what
a thread frees in its own arena. The syncer's threads (gRPC's, the core worker, the ledger) take turns allocating
fragment-sized buffers and payloads, so each arena ends up holding its own high-water mark: a GPT-2 run's syncer
peaked at 3.84–4.28× the fp32 model with the default and 3.67× with two arenas (benchmarks/LOG.md, "Why the arena
cap"). The limit holds only if set before the process's threads start allocating (glibc fixes it when the ninth arena
is made), so the syncer sets it first thing; `MALLOC_ARENA_MAX` in the environment, if set, wins."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ARENAS = 2
M_ARENA_MAX = -8  # glibc's malloc.h


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def heap() -> tuple[int, int] | None:
    """(bytes malloc has handed out and not got back, bytes it got back and keeps in its arenas for reuse), from
    glibc's mallinfo2 (`uordblks` + `hblkhd`, `fordblks`); what it keeps is resident once touched and held by
    nothing. None where that cannot be asked (not glibc, or glibc before 2.33)."""
    try:
        libc = _libc()
        mallinfo2 = libc.mallinfo2 if libc is not None else None
    except (OSError, AttributeError):
        return None
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` unless MALLOC_ARENA_MAX is set; False where that is not possible
    (not glibc) or was left to the environment."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = _libc()
        return libc is not None and bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to cap
        return False
