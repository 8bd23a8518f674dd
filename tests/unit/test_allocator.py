"""The syncer caps glibc's malloc arenas (diloco.allocator): threads that allocate at once share two arenas; the
memory malloc keeps free for reuse is counted."""

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, os, sys, tempfile, threading
    import torch
    from diloco.allocator import limit_arenas
    print(limit_arenas())
    barrier = threading.Barrier(12)
    def work():  # every thread allocates while the others hold their memory: each would get an arena of its own
        barrier.wait()
        held = [torch.empty(50_000) for _ in range(50)]
        barrier.wait()
    threads = [threading.Thread(target=work) for _ in range(12)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    libc = ctypes.CDLL("libc.so.6")
    libc.fdopen.restype = ctypes.c_void_p
    with tempfile.TemporaryFile() as f:
        stream = libc.fdopen(os.dup(f.fileno()), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        f.seek(0)
        print(f.read().count(b"<heap nr="))
""")

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                           reason="malloc arenas are glibc's")


def arenas(env: dict) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    return out[0], int(out[1])


@glibc
def test_the_syncer_caps_malloc_arenas_so_threads_share_freed_memory():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped, count = arenas(env)
    assert capped == "True" and count <= 2


@glibc
def test_malloc_arena_max_in_the_environment_wins():
    capped, count = arenas({**os.environ, "MALLOC_ARENA_MAX": "3"})
    assert capped == "False" and count == 3


HEAP = textwrap.dedent("""
    import ctypes
    from diloco.allocator import heap
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    blocks = [libc.malloc(64 << 10) for _ in range(512)]  # 32 MiB on the heap, under the mmap threshold
    in_use, before = heap()
    for b in blocks[:-1]:  # the last one stays: the freed ones cannot be trimmed off the heap's top
        libc.free(ctypes.c_void_p(b))
    in_use_after, after = heap()
    print(in_use - in_use_after, after - before)
""")


@glibc
def test_memory_given_back_to_malloc_is_counted_as_kept_not_in_use():
    given_back, kept = map(int, subprocess.run([sys.executable, "-c", HEAP], capture_output=True, text=True,
                                               timeout=120, check=True).stdout.split())
    assert given_back >= 511 * (64 << 10)  # no longer in use
    assert kept >= 0.9 * 511 * (64 << 10)  # and kept for reuse (some of it joined free space there was)



LARGE = textwrap.dedent("""
    import ctypes, sys
    from diloco.allocator import heap, map_large
    print(map_large() if sys.argv[1] == "map" else "-")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free(ctypes.c_void_p(libc.malloc(16 << 20)))  # a mapped block freed: glibc raises its threshold past 8 MiB
    blocks = [libc.malloc(8 << 20) for _ in range(8)]
    for b in blocks[:-1]:
        libc.free(ctypes.c_void_p(b))
    print(heap()[1] >= 48 << 20)  # the 56 MiB freed kept in the heap
""")


@glibc
@pytest.mark.parametrize("mapped", [False, True])
def test_large_blocks_freed_go_back_to_the_system_not_to_the_heap(mapped):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", LARGE, "map" if mapped else "default"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == (["True", "False"] if mapped else ["-", "True"])


TRIM = textwrap.dedent("""
    import ctypes, sys
    from diloco.allocator import trim
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)

    def rss_kib():
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
    blocks = [libc.malloc(64 << 10) for _ in range(1024)]  # 64 MiB on the heap, under the mmap threshold, touched
    for b in blocks:
        libc.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:  # the last one stays: the heap's top cannot shrink past it
        libc.free(ctypes.c_void_p(b))
    held = rss_kib()
    print(trim() if sys.argv[1] == "trim" else "-", held - rss_kib())
""")


@glibc
@pytest.mark.parametrize("trimmed", [False, True])
def test_trimming_gives_the_free_heap_back_to_the_system(trimmed):
    out = subprocess.run([sys.executable, "-c", TRIM, "trim" if trimmed else "keep"], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    given_back = int(out[1])
    if trimmed:
        assert out[0] == "True" and given_back >= 48 << 10  # KiB: most of the 63 MiB freed left the process
    else:
        assert given_back < 8 << 10


def test_fragment_sized_blocks_are_mapped_and_message_chunks_are_not():
    from diloco.allocator import MAP_ABOVE
    from diloco.wire.messages import CHUNK_BYTES

    # a chunk's payload, its framing and the bytes object's header stay under; a 17M model's 2.7 MB fragments go over
    assert CHUNK_BYTES + 4096 < MAP_ABOVE < 2_700_000


JEMALLOC_MISSING = None if ctypes.util.find_library("jemalloc") else (
    "jemalloc is not installed: apt-get install libjemalloc2")

ON_JEMALLOC = textwrap.dedent("""
    import ctypes
    from diloco.allocator import heap, name, trim
    libc = ctypes.CDLL(None)  # malloc and free as the process has them: jemalloc's, preloaded
    libc.malloc.restype = ctypes.c_void_p
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    before, _ = heap()
    blocks = [libc.malloc(64 << 10) for _ in range(512)]  # 32 MiB
    for b in blocks:
        libc.memset(b, 1, 64 << 10)
    during, _ = heap()
    for b in blocks:
        libc.free(ctypes.c_void_p(b))
    after, _ = heap()
    print(name(), during - before, during - after, trim())
""")


@pytest.mark.needs(JEMALLOC_MISSING)
def test_on_jemalloc_what_is_handed_out_is_counted_and_purged_on_trim():
    from diloco.allocator import find_jemalloc, preload_env

    env = preload_env({k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}, find_jemalloc())
    out = subprocess.run([sys.executable, "-c", ON_JEMALLOC], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out[0] == "jemalloc" and out[3] == "True"
    # handed out, then given back (jemalloc counts what its threads' caches hold apart: within a MiB)
    assert int(out[1]) >= 31 << 20 and int(out[2]) >= 31 << 20


def test_preloading_keeps_what_the_environment_preloads_and_its_malloc_settings():
    from diloco.allocator import JEMALLOC_CONF, preload_env

    library = "libjemalloc.so.2"
    assert preload_env({}, library) == {"LD_PRELOAD": library, "MALLOC_CONF": JEMALLOC_CONF}
    env = preload_env({"LD_PRELOAD": "libmine.so", "MALLOC_CONF": "narenas:1", "PATH": "/bin"}, library)
    assert env == {"LD_PRELOAD": f"{library} libmine.so", "MALLOC_CONF": "narenas:1", "PATH": "/bin"}
