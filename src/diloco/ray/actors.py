"""The Ray actors of a run: the syncer, pinned to one node, and the ranks of an island.

Each actor runs the same code as the command line (`diloco syncer`, `diloco learner`), so flags, exit codes
(diloco/exits.py) and rejoining behave as documented there. A rank whose island must start again (a rank died, the
syncer was unreachable) ends its own process: Ray restarts the actor (`max_restarts`) and retries its `run` call
(`max_task_retries`), the island's ranks form their gloo group again at the same address, and the leader rejoins
the run under the island's id. Each actor's output goes to a file that is shipped, about every second, to the
syncer's node (`<state>/logs/`), so a lost island's last lines survive it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path

import ray

from diloco import exits

SHIP_SECONDS = 1.0
"""How often an actor's new output lines are sent to the syncer's node."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _capture_output(path: Path) -> None:
    """Send this process's stdout and stderr (Python's and C libraries') to `path`, appending across restarts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


class _Shipper:
    """Tails a local log file and appends its new bytes to the syncer's copy (`SyncerActor.append_log`)."""

    def __init__(self, path: Path, syncer, name: str):
        self.path, self.syncer, self.name = path, syncer, name
        self.offset = path.stat().st_size if path.exists() else 0
        threading.Thread(target=self._loop, name="diloco-log-shipper", daemon=True).start()

    def _loop(self) -> None:
        stop = threading.Event()
        while not stop.wait(SHIP_SECONDS):
            self.ship()

    def ship(self, wait: bool = False) -> None:
        """Send what is new; with `wait`, until the syncer has written it (before this process ends)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(1 << 20)
        except OSError:
            return
        if data:
            self.offset += len(data)
            written = self.syncer.append_log.remote(self.name, data)
            if wait:
                try:
                    ray.get(written, timeout=10)
                except Exception:  # the syncer's node is gone: the local file still has the lines
                    pass


@ray.remote(num_cpus=0)
class SyncerActor:
    """`diloco syncer` inside a Ray actor. Its state, its port and the collected logs live in `state` on its node;
    restarted by Ray it resumes from that state on the same port."""

    def __init__(self, state: str, syncer_args: list[str], listen_host: str = "0.0.0.0"):
        self.state = Path(state)
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "logs").mkdir(exist_ok=True)
        _capture_output(self.state / "logs" / "syncer.log")
        ports = self.state / "ray-ports.json"
        if ports.exists():  # a restart: the islands know these ports
            self.ports = json.loads(ports.read_text())
        else:
            self.ports = {"grpc": _free_port(), "http": _free_port()}
            ports.write_text(json.dumps(self.ports))
        self.host = ray.util.get_node_ip_address()
        argv = ["--log-level", "INFO", "syncer", "--listen", f"{listen_host}:{self.ports['grpc']}",
                "--http", f"{listen_host}:{self.ports['http']}", "--state", str(self.state), *syncer_args]
        (self.state / "ready.json").unlink(missing_ok=True)  # a restart's: ready means this process listens
        self.code: int | None = None
        self.thread = threading.Thread(target=self._serve, args=(argv,), name="diloco-syncer", daemon=True)
        self.thread.start()
        self._wait_ready()

    def _serve(self, argv: list[str]) -> None:
        from diloco.cli import main

        self.code = main(argv)
        print(f"diloco syncer exited with code {self.code}", flush=True)

    def _wait_ready(self, timeout: float = 120.0) -> None:
        import time

        deadline = time.monotonic() + timeout
        while not (self.state / "ready.json").exists() or json.loads((self.state / "ready.json").read_text()).get(
                "grpc_port") != self.ports["grpc"]:
            if self.code is not None:
                raise RuntimeError(f"the syncer exited with code {self.code}; see {self.state / 'logs' / 'syncer.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the syncer did not start in {timeout:.0f} s; see {self.state}/logs/syncer.log")
            time.sleep(0.1)

    def address(self) -> str:
        """HOST:PORT the islands connect to."""
        return f"{self.host}:{self.ports['grpc']}"

    def http_address(self) -> str:
        return f"{self.host}:{self.ports['http']}"

    def pid(self) -> int:
        return os.getpid()

    def append_log(self, name: str, data: bytes) -> None:
        with open(self.state / "logs" / f"{name}.log", "ab") as f:
            f.write(data)

    def exit_code(self) -> int | None:
        """None while the syncer runs."""
        return self.code


@ray.remote(num_cpus=0)
class RankActor:
    """One rank of an island: `diloco learner` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun
    would set them. Rank 0 is the island's leader."""

    def __init__(self, island: str, rank: int, world: int, syncer, log_dir: str):
        self.island, self.rank, self.world = island, rank, world
        name = f"{island}-rank{rank}"
        local = Path(log_dir) / f"{name}.log"
        _capture_output(local)
        self.shipper = _Shipper(local, syncer, name)  # from here on: what this process writes
        print(f"[{island} rank {rank}/{world}] actor started (pid {os.getpid()})", flush=True)

    def endpoint(self) -> tuple[str, int]:
        """Where this rank (the leader) hosts its island's rendezvous: (node address, free port)."""
        return ray.util.get_node_ip_address(), _free_port()

    def pid(self) -> int:
        return os.getpid()

    def run(self, master: tuple[str, int], learner_args: list[str]) -> int:
        """Train until the run ends; returns the exit code when no restart can help (0 finished, 2 or 78 refused).
        Any other ending ends this process, so that Ray restarts the actor and retries this call."""
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(self.world),
                          LOCAL_WORLD_SIZE="1", MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
                          OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        code = exits.FAILED
        try:
            from diloco.cli import main

            code = main(["--log-level", "INFO", "learner", "--id", self.island, *learner_args])
        except BaseException as e:  # a peer rank died: the gloo group is broken
            print(f"[{self.island} rank {self.rank}] the island must restart: {type(e).__name__}: {e}", flush=True)
            code = exits.RETRY
        print(f"[{self.island} rank {self.rank}] learner exit code {code}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self.shipper.ship(wait=True)
        if code in (exits.FINISHED, exits.USAGE, exits.REFUSED):
            return code
        os._exit(code)  # Ray restarts this actor and retries `run`: the island rejoins under its id
