"""The processes of a local run (a syncer and its learners) and what a fault injector may do to them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PY = [sys.executable, "-m", "diloco", "--log-level", "INFO"]


def learner_launcher(ranks: int) -> list[str]:
    """How a learner process starts: plainly, or as a torchrun job of `ranks` ranks (gloo on CPU) on a port of its
    own, so that several islands share this machine."""
    if ranks == 1:
        return PY
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "diloco", "--log-level", "INFO"]


class ClusterError(RuntimeError):
    """A process of the run failed; the message names its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with log.open("a") as f:  # a restarted process continues its log
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen | None, timeout: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with_signal(proc, signal.SIGCONT)  # a paused process cannot handle SIGTERM
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with_signal(proc, signal.SIGKILL)
        proc.wait()


def with_signal(proc: subprocess.Popen | None, sig: int) -> None:
    """Signal the process and everything it started (a torchrun launcher's ranks): each runs in its own session."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


class LocalCluster:
    """A syncer on fixed ports (so it can be restarted on its state) and learners, optionally behind proxies."""

    def __init__(self, out: Path, syncer_args: list[str], learner_args: dict[str, list[str]], proxies: bool = False,
                 ranks_per_learner: int = 1):
        self.out = out
        self.grpc_port, self.http_port = free_port(), free_port()
        self.syncer_cmd = PY + ["syncer", "--listen", f"127.0.0.1:{self.grpc_port}", "--http",
                                f"127.0.0.1:{self.http_port}", *syncer_args]
        self.proxies = {}
        if proxies:
            from diloco.chaos.proxy import ProxyThread

            self.proxies = {lid: ProxyThread(f"127.0.0.1:{self.grpc_port}") for lid in learner_args}
        self.learner_cmds = {
            lid: learner_launcher(ranks_per_learner) + ["learner", "--syncer", self.proxies[lid].address if lid in self.proxies
                       else f"127.0.0.1:{self.grpc_port}", "--id", lid, *args]
            for lid, args in learner_args.items()
        }
        self.syncer: subprocess.Popen | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_file = Path(syncer_args[syncer_args.index("--state") + 1]) / "ready.json"

    def start(self) -> None:
        self.start_syncer()
        for lid in self.learner_cmds:
            self.start_learner(lid)

    def start_syncer(self, timeout: float = 60.0) -> None:
        self.ready_file.unlink(missing_ok=True)
        log = self.out / "logs" / "syncer.log"
        self.syncer = spawn(self.syncer_cmd, log)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.syncer.poll() is not None:
                raise ClusterError(f"the syncer exited with code {self.syncer.returncode} before it was ready; see {log}")
            if time.monotonic() > deadline:
                raise ClusterError(f"the syncer was not ready after {timeout:.0f}s; see {log}")
            time.sleep(0.05)

    def start_learner(self, lid: str) -> None:
        self.procs[lid] = spawn(self.learner_cmds[lid], self.out / "logs" / f"{lid}.log")

    def learners_running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    # ---- what a fault injector may do ---------------------------------------------------------------------
    def _proc(self, target: str) -> subprocess.Popen | None:
        return self.syncer if target == "syncer" else self.procs.get(target)

    def kill(self, target: str) -> None:
        proc = self._proc(target)
        with_signal(proc, signal.SIGKILL)
        if proc is not None:
            proc.wait()

    def restart(self, target: str) -> None:
        if target == "syncer":
            self.start_syncer()
        else:
            self.start_learner(target)

    def pause(self, target: str) -> None:
        with_signal(self._proc(target), signal.SIGSTOP)

    def resume(self, target: str) -> None:
        with_signal(self._proc(target), signal.SIGCONT)

    def partition(self, target: str, seconds: float) -> None:
        if target not in self.proxies:
            raise ClusterError(f"cannot partition {target}: the run was started without proxies")
        self.proxies[target].partition(seconds)

    def shutdown(self) -> None:
        for proc in self.procs.values():
            stop(proc)
        stop(self.syncer)
        for proxy in self.proxies.values():
            proxy.stop()
