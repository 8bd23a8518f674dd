"""The four training strategies, each built from units (unit.py) and combined into goodput and uptime.

- dp:          one non-elastic unit of all chips: a failure stops everything and restarts from a checkpoint.
- dp-elastic:  one elastic unit of all chips: a failure pauses everyone while the job shrinks.
- diloco:      M elastic learners of chips/M; every H steps the outer step waits for all of them.
- decoupled:   M elastic learners of chips/M that never wait for each other; the global model advances
               while at least K of them compute.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from diloco.sim.world import FailureModel, TrainingModel
from diloco.sim.sync_rounds import synchronous_rounds
from diloco.sim.unit import simulate_unit

STRATEGIES = ("dp", "dp-elastic", "diloco", "decoupled")
MULTI_LEARNER = ("diloco", "decoupled")


@dataclass(frozen=True)
class Sample:
    """One simulated run of one cell."""

    goodput: float
    """Useful chip-seconds / allocated chip-seconds."""

    uptime: float
    """Fraction of wall-clock during which the global model advanced."""

    failures: int
    """Failures counted over all units."""


def simulate(strategy: str, chips: int, learners: int, fm: FailureModel, tm: TrainingModel,
             horizon: float, rng: random.Random) -> Sample:
    """Simulate one strategy on `chips` chips (split into `learners` learners) for `horizon` seconds."""
    if strategy == "dp":
        return _single(chips, fm, horizon, rng, elastic=False)
    if strategy == "dp-elastic":
        return _single(chips, fm, horizon, rng, elastic=True)
    if strategy == "decoupled":
        return _decoupled(chips, learners, fm, tm, horizon, rng)
    if strategy == "diloco":
        return _diloco(chips, learners, fm, tm, horizon, rng)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def _single(chips: int, fm: FailureModel, horizon: float, rng: random.Random, *, elastic: bool) -> Sample:
    unit = simulate_unit(chips, fm, horizon, rng, elastic=elastic)
    return Sample(unit.goodput, unit.up_seconds / horizon, unit.failures)


def _learners(chips: int, learners: int, fm: FailureModel, horizon: float, rng: random.Random):
    return [simulate_unit(chips / learners, fm, horizon, rng, elastic=True, record=True)
            for _ in range(learners)]


def _decoupled(chips: int, learners: int, fm: FailureModel, tm: TrainingModel, horizon: float,
               rng: random.Random) -> Sample:
    if tm.quorum > learners:
        raise ValueError(f"quorum {tm.quorum} exceeds the {learners} learners")
    units = _learners(chips, learners, fm, horizon, rng)
    pace = tm.step_seconds / (tm.step_seconds + tm.grace_stall_per_step())
    work = sum(u.work for u in units) * pace
    uptime = time_with_at_least(units, tm.quorum, horizon)
    return Sample(work / (chips * horizon), uptime, sum(u.failures for u in units))


def _diloco(chips: int, learners: int, fm: FailureModel, tm: TrainingModel, horizon: float,
            rng: random.Random) -> Sample:
    units = _learners(chips, learners, fm, horizon, rng)
    result = synchronous_rounds(units, tm, rng)
    if result.wall <= 0:
        return Sample(0.0, 0.0, sum(u.failures for u in units))
    ideal = result.rounds * tm.sync_every * tm.step_seconds
    return Sample(result.work / (chips * result.wall), ideal / result.wall, sum(u.failures for u in units))


def time_with_at_least(units, k: int, horizon: float) -> float:
    """Fraction of [0, horizon) during which at least k units computed (sweep over interval ends)."""
    starts = np.concatenate([np.asarray(u.starts) for u in units])
    ends = np.concatenate([np.asarray(u.ends) for u in units])
    times = np.concatenate([starts, ends])
    steps = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    order = np.argsort(times, kind="stable")
    times, count = times[order], np.cumsum(steps[order])
    spans = np.diff(times)
    return float(spans[count[:-1] >= k].sum() / horizon)
