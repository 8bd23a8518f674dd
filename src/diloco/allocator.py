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


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` unless MALLOC_ARENA_MAX is set; False where that is not possible
    (not glibc) or was left to the environment."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to cap
        return False
