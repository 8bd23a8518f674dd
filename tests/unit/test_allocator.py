"""The syncer caps glibc's malloc arenas (diloco.allocator): threads that allocate at once share two arenas."""

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
