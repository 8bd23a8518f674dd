"""Islands as SLURM jobs, for real: this machine becomes a two-node SLURM cluster (munged, slurmctld, two slurmd
started here as root from a generated slurm.conf), the syncer and two islands (one of two ranks on two nodes) run
from deploy/slurm/*.sbatch, the global loss falls, an island whose ranks are killed restarts inside its allocation
and rejoins under its id, and one stopped by the time limit's signal leaves cleanly, requeues itself and rejoins.

Needs root and Debian's `slurmctld slurmd slurm-client munge` (.ci/run installs them); skipped otherwise, failed
under CI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from diloco.run.local import TINY
from diloco.train.train_config import TrainConfig
from diloco.train.loop import train_config_to_json

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the test starts munged, slurmctld and two slurmd itself"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} not found): apt-get install slurmctld slurmd slurm-client munge"
    return None


pytestmark = [pytest.mark.timeout(480), pytest.mark.slow, pytest.mark.needs(missing())]  # tests/conftest.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what: str, condition, timeout: float = 120.0, period: float = 0.25, logs=None):
    """Poll until `condition()` is truthy and return its value; fail naming `what` (and the logs' last lines)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except (OSError, ValueError, KeyError, subprocess.CalledProcessError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- {p}\n" + p.read_text(errors="replace")[-2500:] for p in (logs() if logs else [])
                            if p.exists())
            pytest.fail(f"{what}: not reached in {timeout:.0f} s{tails}")
        time.sleep(period)


CONF = """\
ClusterName=diloco-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1_port} CPUs=4 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2_port} CPUs=4 State=UNKNOWN
PartitionName=main Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """munged, slurmctld and slurmd n1, n2 on this machine; every process they or their jobs start carries this
    cluster's SLURM_CONF, by which `stop` finds and ends whatever is left."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="dlslurm-", dir="/tmp"))  # short: the munge socket path
        (self.dir / "ctld").mkdir()
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text(CONF.format(host=socket.gethostname(), dir=self.dir, ctld_port=free_port(),
                                         n1_port=free_port(), n2_port=free_port()))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._daemon("munged", ["munged", "-F", "--force", f"--socket={self.dir}/munge.socket", f"--key-file={key}",
                                f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
                                f"--seed-file={self.dir}/munged.seed"])
        wait("munged's socket", lambda: (self.dir / "munge.socket").exists(), 30)
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in ("n1", "n2"):
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        wait("both nodes idle", lambda: self.run("sinfo", "-h", "-N", "-o", "%N %t").split().count("idle") == 2,
             90, logs=self.logs)

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "ab")
        self.daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             start_new_session=True))
        log.close()

    def logs(self) -> list[Path]:
        return sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out"))

    def run(self, *argv: str) -> str:
        return subprocess.run(argv, env=self.env, check=True, capture_output=True, text=True, timeout=60).stdout

    def sbatch(self, script: Path, env: dict, *options: str) -> int:
        out = subprocess.run(["sbatch", "--parsable", *options, str(script)], env={**self.env, **env}, check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return int(out.strip().split(";")[0])

    def job_state(self, job: int) -> str:
        return self.run("squeue", "-h", "-j", str(job), "-o", "%T").strip()

    def stop(self) -> None:
        try:
            if all(d.poll() is None for d in self.daemons[:2]):
                subprocess.run(["scancel", "--user=root"], env=self.env, timeout=30, capture_output=True)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i").strip():
                    time.sleep(0.5)
        except (OSError, subprocess.SubprocessError):
            pass
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.daemons):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.leftovers():  # job processes (slurmstepd, ranks) that outlived their daemons
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[int]:
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if mark in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:
                    pass
        return pids


@pytest.fixture
def cluster():
    c = Cluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()
        assert not c.leftovers(), "processes of the test cluster are still running"
        shutil.rmtree(c.dir, ignore_errors=True)


def status(http_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
        return json.loads(r.read())


def learner(http_port: int, learner_id: str) -> dict:
    return {x["id"]: x for x in status(http_port)["learners"]}.get(learner_id, {})


def joins(tape: Path, learner_id: str) -> list[float]:
    """Wall-clock times of this learner's joins on the syncer's event tape."""
    if not tape.exists():
        return []
    events = (json.loads(line) for line in tape.read_text().splitlines() if line.strip())
    return [e["wall"] for e in events if e.get("event") == "join" and e.get("learner") == learner_id]


def test_islands_as_slurm_jobs_train_and_rejoin_after_a_crash_and_a_requeue(cluster):
    work = cluster.dir / "run"
    (work / "logs").mkdir(parents=True)
    (work / "train.json").write_text(train_config_to_json(replace(TrainConfig(), model=TINY, batch_size=8)))
    grpc_port, http_port = free_port(), free_port()
    common = {"DILOCO_PYTHON": sys.executable, "DILOCO_TOKEN": "slurm-test-secret", "OMP_NUM_THREADS": "1",
              "DILOCO_LOG_DIR": str(work / "logs")}
    output = f"--output={work}/logs/%x-%j.out"
    syncer = cluster.sbatch(ROOT / "deploy" / "slurm" / "syncer.sbatch", {
        **common, "DILOCO_LISTEN": f"127.0.0.1:{grpc_port}", "DILOCO_HTTP": f"127.0.0.1:{http_port}",
        "DILOCO_STATE": str(work / "syncer"),
        "DILOCO_ARGS": "--learners 2 --fragments 4 --sync-every 8 --absent-after-seconds 4"}, output, f"--chdir={work}",
        "--nodelist=n1")
    logs = lambda: cluster.logs() + sorted((work / "logs").glob("*"))  # noqa: E731
    wait("the syncer job ready (/readyz)", lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{http_port}/readyz", timeout=5).status == 200, 120, logs=logs)

    def island(name: str, shard: int, nodes: int) -> int:
        return cluster.sbatch(ROOT / "deploy" / "slurm" / "island.sbatch", {
            **common, "DILOCO_ID": name, "DILOCO_SYNCER": f"127.0.0.1:{grpc_port}", "DILOCO_NPROC_PER_NODE": "1",
            "DILOCO_ARGS": f"--train-config {work / 'train.json'} --shard {shard} --num-shards 2 --device cpu"},
            output, f"--chdir={work}", f"--nodes={nodes}", f"--job-name=island-{name}")

    jobs = {"a": island("a", 0, nodes=2), "b": island("b", 1, nodes=1)}  # a: two ranks, one per node
    wait("both islands merged", lambda: all(learner(http_port, i).get("merged", 0) > 0 for i in jobs), 240, logs=logs)
    # a fresh byte-level model starts at ln(256) = 5.5; trained with the global model's merges it falls well below
    wait("the loss falls below 4.5", lambda: all((learner(http_port, i)["loss"] or 9) < 4.5 for i in jobs), 240,
         logs=logs)
    tape = work / "syncer" / "tape.jsonl"

    # 1. a crash: every process of island b's job step killed (not its batch script); it restarts inside its
    # allocation and rejoins under its id
    merged = learner(http_port, "b")["merged"]
    before = len(joins(tape, "b"))
    step = wait("island b's job step", lambda: [s for s in cluster.run("squeue", "-h", "-s", "-j", str(jobs["b"]),
                                                                        "-o", "%i").split() if s.endswith(".0")])[0]
    killed_at = time.time()
    cluster.run("scancel", "--signal=KILL", step)
    rejoined = wait("island b rejoins after its ranks were killed", lambda: [t for t in joins(tape, "b")[before:]
                                                                             if t > killed_at], 180, logs=logs)
    crash_to_rejoin = rejoined[0] - killed_at
    wait("island b contributes again", lambda: learner(http_port, "b")["merged"] > merged, 120, logs=logs)

    # 2. the time limit's signal (--signal=B:USR1@120 sends exactly this to the batch script): island a pushes what
    # it has, leaves, requeues itself; SLURM holds a requeued job ~2 min (EligibleTime), released here at once
    position = learner(http_port, "a")["data_position"]
    before = len(joins(tape, "a"))
    signalled_at = time.time()
    cluster.run("scancel", "--batch", "--signal=USR1", str(jobs["a"]))
    wait("island a leaves cleanly", lambda: learner(http_port, "a")["state"] == "left", 120, logs=logs)
    left_after = time.time() - signalled_at
    wait("island a requeued", lambda: cluster.job_state(jobs["a"]) == "PENDING", 120, logs=logs)
    released_at, last_release = time.time(), [0.0]

    def released_and_rejoined():
        # a release issued while the requeue is still settling can be dropped: repeat it while the job waits. Not
        # in the requeue's own second: slurmd refuses a credential issued in the second its predecessor's was
        # revoked ("Job credential revoked", and the job ends instead of starting), which SLURM's own two-minute
        # hold of a requeued job avoids
        if time.time() - released_at < 2.0:
            return []
        if time.monotonic() - last_release[0] > 5 and cluster.job_state(jobs["a"]) == "PENDING":
            cluster.run("scontrol", "update", f"JobId={jobs['a']}", "StartTime=now")
            last_release[0] = time.monotonic()
        return [t for t in joins(tape, "a")[before:] if t > released_at]

    rejoined = wait("island a rejoins after its requeue", released_and_rejoined, 240, logs=logs)
    release_to_rejoin = rejoined[0] - released_at
    wait("island a trains again", lambda: learner(http_port, "a")["state"] == "live"
         and learner(http_port, "a")["data_position"] >= position, 120, logs=logs)
    out_a = (work / "logs" / f"island-a-{jobs['a']}.out").read_text()
    assert "requeueing this job (the time limit is near)" in out_a and "restart 1]" in out_a  # one log, appended
    out_b = (work / "logs" / f"island-b-{jobs['b']}.out").read_text()
    assert "attempt 2" in out_b
    print(f"\nSLURM: ranks killed -> rejoined in {crash_to_rejoin:.1f} s (restart inside the allocation); "
          f"USR1 -> left in {left_after:.1f} s; requeued job released -> rejoined in {release_to_rejoin:.1f} s")
    (work / "times.json").write_text(json.dumps({"crash_to_rejoin": crash_to_rejoin, "term_to_left": left_after,
                                                 "release_to_rejoin": release_to_rejoin}))

    # the end: scancel sends SIGTERM everywhere; the syncer saves its state and the final model
    cluster.run("scancel", str(jobs["a"]), str(jobs["b"]), str(syncer))
    wait("every job gone", lambda: not cluster.run("squeue", "-h", "-o", "%i").strip(), 120, logs=logs)
    final = json.loads((work / "syncer" / "syncer.json").read_text())
    assert (work / "syncer" / "model.safetensors").exists() and final["rounds"] > 0
    assert {x["id"] for x in final["learners"]} == {"a", "b"}
