"""glibc's malloc in a syncer process: at most ARENAS arenas, so memory freed by one thread is reused by the others;
large blocks mapped on their own (`map_large`), so what is freed goes back to the system; and what it holds.

glibc gives each thread that allocates while another holds an arena a new arena, up to 8 per core, and keeps what
a thread frees in its own arena. The syncer's threads (gRPC's, the core worker, the ledger) take turns allocating
fragment-sized buffers and payloads, so each arena ends up holding its own high-water mark: a GPT-2 run's syncer
peaked at 3.84–4.28× the fp32 model with the default and 3.67× with two arenas (benchmarks/LOG.md, "Why the arena
cap"). The limit holds only if set before the process's threads start allocating (glibc fixes it when the ninth arena
is made), so the syncer sets it first thing; `MALLOC_ARENA_MAX` in the environment, if set, wins.

jemalloc instead (`preload_env`, the syncer's `--allocator jemalloc`): glibc keeps what short-lived buffers freed
between the long-lived objects of each learner's connection, about 0.7 MiB per learner that joined; jemalloc keeps
blocks of one size together and gives freed pages back within a second (JEMALLOC_CONF), for a slightly higher peak
(benchmarks/LOG.md, "The syncer on jemalloc"). It can only be loaded as a process starts (LD_PRELOAD); `heap` and
`trim` ask whichever allocator the process has."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ARENAS = 2
M_ARENA_MAX = -8  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"
"""Freed pages go back to the system within a second, from a thread of jemalloc's own, not at the next allocation;
`MALLOC_CONF` in the environment, if set, wins."""
ARENAS_ALL = 4096  # jemalloc's MALLCTL_ARENAS_ALL
MAP_ABOVE = (2 << 20) + (64 << 10)
"""Allocations of this size or more get pages of their own, returned to the system when freed; gRPC's message chunks
(`wire.messages.CHUNK_BYTES`, 512 KiB) recur and stay on the heap below it, where mapping each would cost CPU. At
4 MiB, a 17M model's 2.7 MB fragments stayed on the heap, and what they freed made the syncer's peak grow by 2.0–3.7×
the model for six more learners; at this size by 1.0–1.1×, for 0–12% more CPU per push (benchmarks/LOG.md, "Blocks
above a gRPC chunk mapped on their own")."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc():
    """The C library, looked up once: find_library runs `ldconfig -p` in a child process, and /status asks for
    malloc's figures every few seconds."""
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


@functools.cache
def _mallctl():
    """jemalloc's control function where this process runs on jemalloc, else None."""
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                        ctypes.c_size_t]
    return mallctl


def name() -> str:
    """The allocator this process runs on: "jemalloc", "glibc" or "other"."""
    if _mallctl() is not None:
        return "jemalloc"
    libc = _libc()
    return "glibc" if libc is not None and hasattr(libc, "mallinfo2") else "other"


def find_jemalloc() -> str | None:
    """jemalloc's library name (libjemalloc.so.2 from Debian's libjemalloc2) where the system's loader finds it, else None."""
    return ctypes.util.find_library("jemalloc")


def preload_env(env: dict[str, str], library: str) -> dict[str, str]:
    """`env` for a process that runs on jemalloc (`library`, from `find_jemalloc`): LD_PRELOAD, and JEMALLOC_CONF
    unless MALLOC_CONF is set."""
    preload = " ".join(filter(None, [library, env.get("LD_PRELOAD", "")]))
    return {**env, "LD_PRELOAD": preload, "MALLOC_CONF": env.get("MALLOC_CONF", JEMALLOC_CONF)}


def _jemalloc_heap(mallctl) -> tuple[int, int] | None:
    epoch, value, size = ctypes.c_uint64(1), ctypes.c_size_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
    if mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch)):  # refreshes the statistics
        return None
    figures = []
    for key in (b"stats.allocated", b"stats.resident"):
        if mallctl(key, ctypes.byref(value), ctypes.byref(size), None, 0):
            return None  # built without statistics
        figures.append(int(value.value))
    allocated, resident = figures
    return allocated, max(0, resident - allocated)


def heap() -> tuple[int, int] | None:
    """(bytes malloc has handed out and not got back, bytes it got back and keeps in its arenas for reuse), from
    glibc's mallinfo2 (`uordblks` + `hblkhd`, `fordblks`), or jemalloc's statistics (allocated; resident minus
    allocated, its own bookkeeping included); what it keeps is resident once touched and held by nothing. None where
    that cannot be asked (neither, or glibc before 2.33)."""
    mallctl = _mallctl()
    if mallctl is not None:
        return _jemalloc_heap(mallctl)
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


def map_large(threshold: int = MAP_ABOVE) -> bool:
    """Serve allocations of `threshold` bytes or more with pages of their own (mmap), given back when freed, unless
    MALLOC_MMAP_THRESHOLD_ is set; False where that is not possible. glibc raises its threshold to the size of each
    mapped block freed (up to 32 MiB), after which fragment-sized payloads and temporaries came from the heap and
    what they freed stayed there: a 64-learner load's syncer kept 2.7 GiB free and resident at its peak
    (benchmarks/LOG.md, "The syncer under a load shaped like a real run"). Fragment-sized buffers that recur are
    reused on purpose (syncer/buffers.py), so few mappings are made anew; message chunks stay on the heap."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or _mallctl() is not None:
        return False
    try:
        libc = _libc()
        return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def trim() -> bool:
    """Give back to the system the free memory malloc keeps in its arenas (glibc's malloc_trim(0), which also
    releases whole free pages inside the heap); False where that is not possible. It holds each arena's lock while
    it walks it: call it off the event loop. On jemalloc: every arena's unused pages purged."""
    mallctl = _mallctl()
    if mallctl is not None:
        return not mallctl(f"arena.{ARENAS_ALL}.purge".encode(), None, None, None, 0)
    try:
        libc = _libc()
        return libc is not None and bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` unless MALLOC_ARENA_MAX is set; False where that is not possible
    (not glibc) or was left to the environment."""
    if "MALLOC_ARENA_MAX" in os.environ or _mallctl() is not None:
        return False
    try:
        libc = _libc()
        return libc is not None and bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to cap
        return False
