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

from diloco import procs

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


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`cmd` in a session of its own (so a signal reaches a torchrun launcher's ranks too), dying with this process
    even when it is SIGKILLed (diloco.procs)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = procs.child_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {})))
    with log.open("a") as f:  # a restarted process continues its log
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=procs.die_with_parent())


def stop_all(procs: list[subprocess.Popen | None], timeout: float = 30.0) -> None:
    """SIGTERM to every process at once, then one shared deadline before SIGKILL: each leaves cleanly in parallel,
    none waits for another. Ctrl-C while they leave kills them all at once."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for proc in live:
        with_signal(proc, signal.SIGCONT)  # a paused process cannot handle SIGTERM
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:  # the deadline passed, or a second Ctrl-C: nothing is left running
        for proc in live:
            if proc.poll() is None:
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
    """Syncers on fixed ports (so they can be restarted on their state) — one, or the shards of a sharded syncer,
    each given its own arguments — and learners, optionally behind proxies (one per learner and syncer shard).

    With `links` (run/links.py) learner i runs in the namespace of link i and reaches the syncers through proxies
    on the bridge's address; the syncers stay on loopback. `latency_ms` is added by those proxies, each way."""

    def __init__(self, out: Path, syncer_args: list[list[str]], learner_args: dict[str, list[str]],
                 proxies: bool = False, ranks_per_learner: int = 1, links=None, latency_ms: float = 0.0,
                 http: str | None = None):
        self.out = out
        self.grpc_ports = [free_port() for _ in syncer_args]
        port = int(http.rsplit(":", 1)[1]) if http else None  # on 127.0.0.1, where /status is read
        self.http_ports = [port + i if port else free_port() for i in range(len(syncer_args))]
        self.grpc_port, self.http_port = self.grpc_ports[0], self.http_ports[0]
        self.syncer_cmds = [PY + ["syncer", "--listen", f"127.0.0.1:{g}", "--http", f"127.0.0.1:{h}", *args]
                            for g, h, args in zip(self.grpc_ports, self.http_ports, syncer_args)]
        self.proxies: dict[str, list] = {}
        if proxies or links is not None or latency_ms:
            from diloco.chaos.proxy import LinkFaults, ProxyThread

            listen = f"{links.host_address}:0" if links is not None else "127.0.0.1:0"
            faults = LinkFaults(latency_ms=latency_ms)
            self.proxies = {lid: [ProxyThread(f"127.0.0.1:{g}", listen, faults) for g in self.grpc_ports]
                            for lid in learner_args}
        self.address = ",".join(f"127.0.0.1:{g}" for g in self.grpc_ports)
        self.learner_cmds = {}
        for i, (lid, args) in enumerate(learner_args.items()):
            target = ",".join(p.address for p in self.proxies[lid]) if lid in self.proxies else self.address
            cmd = learner_launcher(ranks_per_learner) + ["learner", "--syncer", target, "--id", lid, *args]
            self.learner_cmds[lid] = links.wrap(i, cmd) if links is not None else cmd
        self.syncers: list[subprocess.Popen | None] = [None] * len(syncer_args)
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_files = [Path(args[args.index("--state") + 1]) / "ready.json" for args in syncer_args]

    @property
    def syncer(self) -> subprocess.Popen | None:
        return self.syncers[0]

    def start(self) -> None:
        for shard in range(len(self.syncers)):
            self.start_syncer(shard)
        for lid in self.learner_cmds:
            self.start_learner(lid)

    def start_syncer(self, shard: int = 0, timeout: float = 60.0) -> None:
        self.ready_files[shard].unlink(missing_ok=True)
        name = "syncer" if len(self.syncers) == 1 else f"syncer-{shard}"
        log = self.out / "logs" / f"{name}.log"
        proc = self.syncers[shard] = spawn(self.syncer_cmds[shard], log)
        deadline = time.monotonic() + timeout
        while not self.ready_files[shard].exists():
            if proc.poll() is not None:
                raise ClusterError(f"the {name} exited with code {proc.returncode} before it was ready; see {log}")
            if time.monotonic() > deadline:
                raise ClusterError(f"the {name} was not ready after {timeout:.0f}s; see {log}")
            time.sleep(0.05)

    def start_learner(self, lid: str) -> None:
        self.procs[lid] = spawn(self.learner_cmds[lid], self.out / "logs" / f"{lid}.log")

    def learners_running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def status(self) -> dict | None:
        """The syncer's /status; of shards, one view of them all (run/shards.py), None while one is missing."""
        statuses = []
        for port in self.http_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as r:
                    statuses.append(json.loads(r.read()))
            except (OSError, ValueError):
                return None
        if len(statuses) == 1:
            return statuses[0]
        from diloco.run.shards import combined_status

        return combined_status(statuses)

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
        for proxy in self.proxies[target]:  # its link to every shard
            proxy.partition(seconds)

    def shutdown(self) -> None:
        """Every learner leaves at once (pushing what it has left), then the syncers write their final state."""
        try:
            stop_all(list(self.procs.values()))
            stop_all(self.syncers)
        finally:
            for proxies in self.proxies.values():
                for proxy in proxies:
                    proxy.stop()


class RunFailed(RuntimeError):
    """A process of the run failed; the message names its log."""


def collect_summaries(plan, procs: dict[str, subprocess.Popen]) -> list[dict]:
    """Each learner's summary file in `plan.out` (or just its id when it died before writing one) and exit code."""
    learners = []
    for lid, p in procs.items():
        path = plan.out / "learners" / f"{lid}.json"
        summary = json.loads(path.read_text()) if path.exists() else {"id": lid}
        summary["exit_code"] = p.returncode
        learners.append(summary)
    return learners
