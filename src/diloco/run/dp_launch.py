"""`diloco run --mode dp`: one data-parallel worker process per learner slot, progress from their metrics.

A synchronous job cannot go on without one of its workers (the others would wait in the all-reduce), so when any
worker dies the launcher kills the rest and restarts all of them from the last checkpoint, as a real job does.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from diloco.atomic import write_json
from diloco.baselines.dp import latest_checkpoint, ring_allreduce_bytes
from diloco.run.cluster import RunFailed, collect_summaries, spawn, stop_all
from diloco.run.report import read_metrics

MAX_RESTARTS = 20
CHECKPOINT_EVERY = 50
TICK = 0.5  # seconds between looks at the workers

Procs = dict[str, subprocess.Popen]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_from_metrics(plan, procs) -> dict:
    metrics = read_metrics(plan.out / "metrics")
    learners, steps = [], 0
    for i, speed in enumerate(plan.speeds):
        lid = f"learner-{i}"
        last = (metrics.get(lid) or [{}])[-1]
        steps = max(steps, last.get("step", 0))
        running = procs[lid].poll() is None
        learners.append({"id": lid, "state": "live" if running else "done", "speed": speed, "step": last.get("step"),
                         "loss": last.get("loss"), "tokens_per_second": last.get("tokens_per_second"),
                         "pushes": last.get("pushes"), "applied": last.get("applied")})
    tokens = sum(x.get("step") or 0 for x in learners) * plan.train.tokens_per_step()
    return {"mode": "dp", "rounds": steps, "versions": [steps], "tokens_trained": tokens, "tokens_merged": tokens,
            "learners": learners}


def outcome(codes: list[int | None]) -> str:
    """'failed' as soon as any worker exits non-zero or by a signal, 'done' once all exit cleanly, else 'running'."""
    if any(c not in (None, 0) for c in codes):
        return "failed"
    return "done" if all(c == 0 for c in codes) else "running"


def log_path(plan, lid: str, restarts: int) -> Path:
    return plan.out / "logs" / (f"{lid}.log" if restarts == 0 else f"{lid}.restart-{restarts}.log")


def start_workers(plan, job: dict, restarts: int, links=None) -> Procs:
    """All M workers on a fresh rendezvous port (the old one may linger in TIME_WAIT); they resume from the
    newest checkpoint in the same out dir. With `links` (run/links.py) worker i runs in link i's namespace, the
    rendezvous is on worker 0's address and gloo uses each namespace's link, so every all-reduce byte crosses the
    shaped links of its sender and its receiver."""
    port, out = _free_port(), plan.out / "dp"
    master, env = "127.0.0.1", None
    if links is not None:
        from diloco.run.links import INSIDE_IF

        master, env = links.links[0].address, {"GLOO_SOCKET_IFNAME": INSIDE_IF}
    procs = {}
    for i, speed in enumerate(plan.speeds):
        cmd = [sys.executable, "-m", "diloco.baselines.dp", "--rank", str(i), "--world", str(plan.learners),
               "--master-addr", master, "--port", str(port), "--train-config", str(plan.out / "train_config.json"),
               "--out", str(out),
               "--speed", str(speed), "--restart-count", str(restarts),
               "--checkpoint-every", str(job["checkpoint_every"]), "--snapshot-every", str(job["snapshot_every"])]
        if job["steps"]:
            cmd += ["--max-steps", str(job["steps"])]
        if plan.pace:
            cmd += ["--pace", str(plan.pace)]
        if plan.tensorboard:
            cmd += ["--tensorboard", str(plan.tensorboard)]
        if job["duration"]:  # the job's deadline is fixed by its first training step (dp.job_clock)
            cmd += ["--duration", str(job["duration"])]
        if links is not None:
            cmd = links.wrap(i, cmd)
        procs[f"learner-{i}"] = spawn(cmd, log_path(plan, f"learner-{i}", restarts), env)
    return procs


def watch(plan, procs: Procs, progress, on_tick) -> bool:
    """Until every worker has exited cleanly (True) or one has failed (False)."""
    while True:
        if on_tick is not None:
            on_tick(procs)
        state = outcome([p.poll() for p in procs.values()])
        progress.update(status_from_metrics(plan, procs))
        if state != "running":
            return state == "done"
        time.sleep(TICK)


def kill_all(procs: Procs) -> None:
    """SIGKILL, not SIGTERM: a worker blocked in an all-reduce with a dead peer would not get to handle it."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
    for p in procs.values():
        p.wait()


def steps_executed(metrics: dict[str, list[dict]]) -> int:
    """All-reduces performed, recomputed steps included: per attempt, the most steps any worker logged."""
    lines = Counter((x.get("restarts", 0), lid) for lid, xs in metrics.items() for x in xs)
    most: dict[int, int] = {}
    for (attempt, _), n in lines.items():
        most[attempt] = max(most.get(attempt, 0), n)
    return sum(most.values())


def record(plan, restarts: list[dict]) -> dict:
    """dp.json as rank 0 wrote it, plus what only the launcher knows: restarts, recomputed steps, all wire bytes."""
    path = plan.out / "dp" / "dp.json"
    result = json.loads(path.read_text())
    executed = steps_executed(read_metrics(plan.out / "metrics"))
    per_step = plan.learners * ring_allreduce_bytes(plan.learners, 4 * result["parameters"])
    result.update(steps_executed=executed, lost_steps=executed - result["steps"], wire_bytes=per_step * executed,
                  restarts=restarts)
    write_json(path, result, indent=2)
    return result


def run_dp(plan, progress, on_tick: Callable[[Procs], None] | None = None, max_restarts: int = MAX_RESTARTS,
           checkpoint_every: int = CHECKPOINT_EVERY, links=None):
    """Train to the plan's budget, restarting the whole job from its last checkpoint whenever a worker dies.

    `on_tick(procs)` is called about every 0.5 s with the current workers (id → Popen), so a fault injector can
    SIGKILL one; the launcher notices and restarts the job.
    """
    tokens_per_round = plan.learners * plan.train.tokens_per_step()
    steps = plan.steps or (-(-plan.tokens // tokens_per_round) if plan.tokens else None)
    job = {"steps": steps, "duration": plan.duration, "checkpoint_every": checkpoint_every,
           "snapshot_every": max(1, steps // plan.snapshots) if steps else 25}
    restarts: list[dict] = []
    procs: Procs = {}
    try:
        with progress:
            while True:
                procs = start_workers(plan, job, len(restarts), links)
                if watch(plan, procs, progress, on_tick):
                    break
                kill_all(procs)
                if len(restarts) >= max_restarts:
                    logs = ", ".join(str(log_path(plan, lid, len(restarts))) for lid in procs)
                    raise RunFailed(f"data-parallel run failed {len(restarts) + 1} times, more than max_restarts="
                                    f"{max_restarts} allow; the last attempt's logs: {logs}")
                found = latest_checkpoint(plan.out / "dp" / "checkpoint")
                restarts.append({"at_unix": round(time.time(), 3), "resumed_step": found[0] if found else 0})
    finally:
        stop_all(list(procs.values()))
    learners = collect_summaries(plan, procs)
    if not (plan.out / "dp" / "dp.json").exists():
        raise RunFailed(f"data-parallel run failed; see {plan.out / 'logs'}")
    return learners, record(plan, restarts)
