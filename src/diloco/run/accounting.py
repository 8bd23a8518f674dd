"""Goodput and uptime of a run (docs/algorithm.md §9) from per-step metric lines and the injected fault timeline."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

SETTLE_SECONDS = 5.0
"""After a fault ends the cluster is not yet healthy: a restarted process spends seconds importing and joining."""
MIN_HEALTHY_STEPS = 10
"""Fewer steps than this in fault-free time and a learner's healthy rate falls back to all its steps."""


@dataclass(frozen=True)
class Window:
    start: float
    end: float


def fault_windows(faults: list[dict], origin: float) -> list[Window]:
    """The timeline's faults (seconds after `origin`) as absolute windows on the metric lines' clock."""
    return [Window(origin + f["start"], origin + f["end"]) for f in faults]


def healthy(t: float, windows: list[Window]) -> bool:
    """No fault active at `t`, nor ending less than SETTLE_SECONDS before it."""
    return not any(w.start <= t < w.end + SETTLE_SECONDS for w in windows)


def healthy_rate(lines: list[dict], windows: list[Window], tokens_per_step: int) -> float:
    """Tokens/s of one learner's steps taken while the run had no fault (its healthy speed, docs/algorithm.md §9)."""
    if not lines:
        return 0.0
    busy = [x["busy"] for x in lines if healthy(x["t"], windows)]
    if len(busy) < MIN_HEALTHY_STEPS:
        busy = [x["busy"] for x in lines]
    return tokens_per_step / statistics.median_high(busy)


def paced_rate(tokens_per_step: int, speed: float, pace: float) -> float:
    """Tokens/s a paced learner was allocated: one step of `tokens_per_step` every pace/speed seconds."""
    return tokens_per_step * speed / pace


def goodput(tokens_merged: float, rates: dict[str, float], wall: float) -> float:
    """Merged tokens over what every learner could have processed at its healthy rate over the whole run.

    With pacing each rate is the allocated one (paced_rate) and goodput ≤ 1 by construction. Unpaced, each rate
    is measured in fault-free time; where learners share machines a killed learner frees cores, the others speed
    up, and goodput can exceed 1.
    """
    capacity = sum(rates.values()) * wall
    return tokens_merged / capacity if capacity > 0 else 0.0


def advance_interval(cfg: dict, step_seconds: float) -> float:
    """Seconds within which a syncer's model is expected to advance: some fragment is due every H/P steps (twice
    that, as slack), later by up to the grace_expect_steps step times a round is held open for predicted pushes."""
    return (2 * cfg["sync_every"] / cfg["fragments"] + cfg.get("grace_expect_steps", 0.0)) * step_seconds


def uptime(advances: list[float], start: float, end: float, interval: float) -> float:
    """Share of [start, end) cut into windows of `interval` seconds in which the model advanced at least once (the
    report's: 2 steps for dp, `advance_interval` for a syncer)."""
    if end <= start or interval <= 0:
        return 0.0
    windows = max(1, int((end - start) // interval))
    hit = {min(int((t - start) // interval), windows - 1) for t in advances if start <= t < start + windows * interval}
    return len(hit) / windows


def new_steps(lines: list[dict]) -> list[float]:
    """Times at which a data-parallel model reached a step it never had: steps recomputed after a restart from
    a checkpoint redo lost work and do not advance the model."""
    out, reached = [], 0
    for x in lines:
        if x["step"] > reached:
            out.append(x["t"])
            reached = x["step"]
    return out


def tokens_per_life(lines: list[dict]) -> list[int]:
    """Tokens trained in each process life of one learner: its step counter restarts at 1 after a restart."""
    lives: list[int] = []
    for x in lines:
        if x.get("step") == 1 or not lives:
            lives.append(0)
        lives[-1] = max(lives[-1], x.get("tokens", 0))
    return lives
