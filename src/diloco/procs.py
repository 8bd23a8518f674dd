"""Child processes that never outlive the process that started them, even when it is killed with SIGKILL.

Linux's PR_SET_PDEATHSIG has the kernel send a signal to a process when its parent dies. We set it to SIGKILL
between fork and exec (`die_with_parent`, a `preexec_fn`), and, for torchrun's ranks, whose launcher starts them
in sessions of their own where no process-group signal reaches, in the rank itself at start-up
(`die_with_parent_now`). The chain then holds at every level: run → launcher → ranks.

Why not a process group and a watchdog: a group signal misses torchrun's ranks (each in its own session), and a
watchdog is one more process that can itself be killed; the kernel's signal cannot be skipped. Why SIGKILL and not
SIGTERM: a child frozen with SIGSTOP (the `hang` fault) never handles SIGTERM, and a syncer's state is durable
anyway (docs/algorithm.md §8). Elsewhere than Linux these are no-ops: children end when their parent stops them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
ANCESTOR_ENV = "DILOCO_DIE_WITH"
"""Pid a process started by `diloco run` must not outlive: set for its children, read by torchrun's ranks."""


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc.prctl


_PRCTL = _prctl()  # resolved once, here: the child between fork and exec should do as little as possible


def die_with_parent():
    """A `preexec_fn` for subprocess.Popen: the child gets SIGKILL when the thread that started it exits, so start
    children from a thread that lives as long as they should (the main thread). None where unsupported."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above: no signal will come
            os._exit(1)

    return preexec


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child started with `die_with_parent`: it tells the child's own children (torchrun's
    ranks) which process they must not outlive."""
    return {**(env if env is not None else os.environ), ANCESTOR_ENV: str(os.getpid())}


def ancestors(pid: int, depth: int = 4) -> list[int]:
    """`pid`'s parent, grandparent, ... up to `depth` levels, from /proc."""
    out = []
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
        out.append(pid)
    return out


def die_with_parent_now() -> None:
    """In a process started by a launcher we do not control (torchrun's ranks): SIGKILL when its parent dies, and
    exit at once if the process named by DILOCO_DIE_WITH is already gone from its ancestry."""
    wanted = os.environ.get(ANCESTOR_ENV)
    if _PRCTL is None or not wanted:
        return
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if int(wanted) not in ancestors(os.getpid()):
        os._exit(1)
