"""Processes never outlive their run: `diloco run` killed with SIGKILL takes its syncer and learners (torchrun's
ranks included) with it, and `diloco syncer --duration N` ends by itself (keeping its final model where it says, --state or not)."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from liveness import wait_for

pytestmark = pytest.mark.timeout(300)
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def alive(pid: int) -> bool:
    s = stat(pid)
    return s is not None and s[1] != "Z"  # a zombie has died; only its exit status waits to be collected


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := stat(int(entry.name))) is not None:
            children.setdefault(s[0], []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("learners, ranks", [(2, 1), (1, 2)])
def test_run_killed_with_sigkill_takes_every_child_with_it(tmp_path, learners, ranks):
    http, out = free_port(), tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "diloco", "run", "--model", "tiny", "--learners", str(learners),
                            "--ranks-per-learner", str(ranks), "--duration", "600", "--no-progress",
                            "--http", f"127.0.0.1:{http}", "--out", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    children: set[int] = set()
    try:
        ready = out / "syncer" / "ready.json"
        # every learner process, and under torchrun every rank, has started: launcher + ranks per learner
        expected = 1 + learners * (ranks + 1 if ranks > 1 else 1)
        wait_for(lambda: ready.exists() and listening(http) and len(descendants(run.pid)) >= expected, timeout=180)
        grpc = json.loads(ready.read_text())["grpc_port"]
        children = descendants(run.pid)
        assert listening(grpc)
        run.send_signal(signal.SIGKILL)
        run.wait(30)
        wait_for(lambda: not any(alive(pid) for pid in children), timeout=60)
        wait_for(lambda: not listening(http) and not listening(grpc), timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
        kill_all(children)


def test_syncer_with_a_duration_exits_by_itself_and_keeps_its_model_without_state(tmp_path):
    """Started without --state, the syncer keeps its state in a new runs/syncer-* folder, says so first and last."""
    syncer = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "--listen", "127.0.0.1:0", "--http",
                               "127.0.0.1:0", "--duration", "3", "--fragments", "2", "--sync-every", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    learner = None
    try:
        wait_for(lambda: list(tmp_path.glob("runs/syncer-*/ready.json")) or syncer.poll() is not None, timeout=120)
        assert syncer.poll() is None
        ready, = tmp_path.glob("runs/syncer-*/ready.json")
        state = ready.parent.relative_to(tmp_path)
        port = json.loads(ready.read_text())["grpc_port"]
        learner = subprocess.Popen([sys.executable, "-m", "diloco", "learner", "--syncer", f"127.0.0.1:{port}",
                                    "--id", "a", "--model", "tiny", "--batch-size", "4"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        output, _ = syncer.communicate(timeout=180)  # nobody stops it: the budget does
        assert syncer.returncode == 0, output[-3000:]
        assert f"no --state given: the syncer keeps its state and the final model in {state} " in output
        assert f"the final model is {state / 'model.safetensors'}" in output.splitlines()[-1]
        assert (tmp_path / state / "model.safetensors").exists()
        assert learner.wait(60) == 0
    finally:
        for proc in (learner, syncer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_stop_all_signals_every_process_before_waiting_for_any(tmp_path):
    """Each process leaves only once every other one has been asked to: stopping them one at a time would hold
    the first until its deadline and SIGKILL it."""
    from diloco.run.cluster import spawn, stop_all

    n = 3
    leave = ("import pathlib, signal, sys, time\n"
             "d, i, n = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])\n"
             "signal.signal(signal.SIGTERM, lambda *a: (d / f'signalled-{i}').touch())\n"
             "(d / f'ready-{i}').touch()\n"
             "while len(list(d.glob('signalled-*'))) < n:\n"
             "    time.sleep(0.05)\n")
    procs = [spawn([sys.executable, "-c", leave, str(tmp_path), str(i), str(n)], tmp_path / "logs" / f"{i}.log")
             for i in range(n)]
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == n, timeout=120)
        stop_all(procs, timeout=60)
        assert [p.returncode for p in procs] == [0] * n
    finally:
        kill_all(p.pid for p in procs)


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_still_writes_the_report(tmp_path):
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "diloco", "run", "--model", "tiny", "--learners", "2", "--duration",
                            "600", "--no-progress", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                           # SIGINT acts as Ctrl-C (not inherited as ignored from a shell that ran the tests in the
                           # background)
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    children: set[int] = set()
    try:
        metrics = out / "metrics"
        wait_for(lambda: len([p for p in metrics.glob("*.jsonl") if p.stat().st_size]) == 2, timeout=180)
        children = descendants(run.pid)
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=240)
        assert run.returncode == 130, stderr[-3000:]
        assert not any(alive(pid) for pid in children)
        assert f"interrupted; run directory {out}" in stderr.replace("\n", " ")
        report = json.loads((out / "report.json").read_text())
        assert report["tokens_trained"] > 0 and (out / "model.safetensors").exists()
        assert all(s["exit_code"] == 0 for s in report["per_learner"])  # each left cleanly, none was killed
        assert "wall-clock" in stdout
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
        kill_all(children)


FORKS_WITH_A_LIVE_LEARNER = """
import subprocess
from torch import nn
from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode
syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, heartbeat_seconds=0.01), ServerOptions(listen="127.0.0.1:0", http=None))
learner = Learner(nn.Linear(64, 64), GrpcTransport(syncer.address), "a")  # heartbeats every 10 ms: gRPC is busy
codes = [subprocess.run(["true"], preexec_fn=lambda: None, capture_output=True).returncode for _ in range(200)]
learner.close()
syncer.stop()
print(sum(code != 0 for code in codes))
"""


def test_children_started_with_a_preexec_fn_survive_a_live_grpc_channel():
    """`diloco run` starts its processes with a preexec_fn (so they die with it). That forks, and gRPC's fork support
    then restarted its poller in the child, which aborted once the child closed its descriptors: about 1 start in 20
    failed with a Learner's channel live (grpc/grpc#43055), so importing diloco turns gRPC's fork support off."""
    env = {k: v for k, v in ENV.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    result = subprocess.run([sys.executable, "-c", FORKS_WITH_A_LIVE_LEARNER], capture_output=True, text=True,
                            env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "0", result.stderr[-2000:]  # children that died before exec, of 200
