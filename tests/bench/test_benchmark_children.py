"""A benchmark ended by any signal, SIGKILL included, leaves none of the processes it started running: each child
gets SIGKILL from the kernel when the benchmark dies (`diloco.procs.die_with_parent`)."""

import ast
import os
import signal
import subprocess
from pathlib import Path

import pytest

from benchmarks import ROOT, child_env, module_command
from liveness import wait_for

QUERIES = {"provenance.py", "corpus.py"}
"""Ask git or npm one short question each; nothing of theirs runs on."""


def child_starts(path: Path) -> list[ast.Call]:
    """The `subprocess.run(...)` and `subprocess.Popen(...)` calls in a file."""
    return [node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("run", "Popen") and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "subprocess"]


def test_every_child_a_benchmark_starts_dies_with_it():
    calls = [(path, call) for path in (ROOT / "benchmarks").rglob("*.py") if path.name not in QUERIES
             for call in child_starts(path)]
    assert len(calls) >= 10
    unbound = [f"{path.relative_to(ROOT)}:{call.lineno}" for path, call in calls
               if not any(keyword.arg == "preexec_fn" for keyword in call.keywords)]
    assert not unbound, f"children that would outlive their benchmark: {unbound}"


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each live process whose parent is `pid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state != "Z":
            out.append((int(entry.name), cmdline))
    return out


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(240)
def test_a_benchmark_killed_mid_run_leaves_no_syncer_running():
    bench = subprocess.Popen([*module_command("benchmarks.syncer.memory_learners"), "--learners", "2", "--params",
                              "2.4e5", "--steps", "100000"], env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    found: list[int] = []

    def syncer_started() -> bool:
        assert bench.poll() is None, f"the benchmark ended first ({bench.returncode})"
        found.extend(pid for pid, cmdline in children(bench.pid) if " syncer " in cmdline)
        return bool(found)

    syncer = None
    try:
        wait_for(syncer_started, timeout=180)
        syncer = found[0]
        bench.kill()
        bench.wait()
        wait_for(lambda: not running(syncer), timeout=30)  # the kernel's SIGKILL, once its parent is gone
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if syncer is not None and running(syncer):
            os.kill(syncer, signal.SIGKILL)
