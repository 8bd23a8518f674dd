"""`diloco run --mode dp`: one data-parallel worker process per learner slot, progress from their metrics."""

from __future__ import annotations

import json
import socket
import sys

from diloco.run.local import RunFailed, _spawn, _stop, collect_summaries, supervise
from diloco.run.report import read_metrics


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


def run_dp(plan, progress):
    tokens_per_round = plan.learners * plan.train.tokens_per_step()
    steps = plan.steps or (-(-plan.tokens // tokens_per_round) if plan.tokens else None)
    port, out = _free_port(), plan.out / "dp"
    procs = {}
    for i, speed in enumerate(plan.speeds):
        cmd = [sys.executable, "-m", "diloco.baselines.dp", "--rank", str(i), "--world", str(plan.learners),
               "--port", str(port), "--train-config", str(plan.out / "train_config.json"), "--out", str(out),
               "--speed", str(speed)]
        if steps:
            cmd += ["--max-steps", str(steps), "--snapshot-every", str(max(1, steps // 8))]
        if plan.duration:
            cmd += ["--duration", str(plan.duration), "--snapshot-every", "25"]
        procs[f"learner-{i}"] = _spawn(cmd, plan.out / "logs" / f"learner-{i}.log")
    try:
        supervise(procs, progress, lambda: status_from_metrics(plan, procs))
    finally:
        for p in procs.values():
            _stop(p)
    learners = collect_summaries(plan, procs)
    if not (out / "dp.json").exists():
        raise RunFailed(f"data-parallel run failed; see {plan.out / 'logs'}")
    return learners, json.loads((out / "dp.json").read_text())
