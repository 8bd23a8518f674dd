"""Synchronous DiLoCo's outer loop over independently simulated learners.

Each round every learner needs H steps of computing (with step-time noise); a learner that is paused (shrink,
grow, all slices down) takes longer. The outer step starts when the slowest learner is done and blocks
everyone for `diloco_sync_seconds`. Learners that finish early idle, which is what synchronous DiLoCo loses.
A learner idling at the barrier stays powered, so its chips keep failing as simulated by its own timeline.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from diloco.sim.world import TrainingModel
from diloco.sim.unit import UnitRun


_CHUNK = 1024  # rounds of step-time noise drawn at once


@dataclass(frozen=True)
class RoundsResult:
    """Outcome of the outer loop."""

    rounds: int
    """Outer steps completed."""

    wall: float
    """Time at which the last completed outer step ended."""

    work: float
    """Chip-seconds computed inside completed rounds."""


def synchronous_rounds(units: list[UnitRun], tm: TrainingModel, rng: random.Random) -> RoundsResult:
    compute = tm.sync_every * tm.step_seconds
    # A round is the sum of H steps, so its noise shrinks as 1/sqrt(H); gamma keeps it positive.
    cv = tm.step_time_cv / tm.sync_every ** 0.5
    noise = np.random.default_rng(rng.getrandbits(63))
    cursors = [0] * len(units)
    # The interval each learner's cursor points at, cached for the common uninterrupted round.
    begin = [u.starts[0] if u.starts else math.inf for u in units]
    stop = [u.ends[0] if u.ends else -math.inf for u in units]
    chips = [u.running[0] if u.running else 0.0 for u in units]
    start = done_wall = done_work = 0.0
    rounds = 0
    needs: list[list[float]] = []
    while True:
        if rounds % _CHUNK == 0:
            needs = _draw_needs(noise, compute, cv, len(units))
        finish = start
        work = 0.0
        for m, need in enumerate(needs[rounds % _CHUNK]):
            end = start + need
            if begin[m] <= start and end <= stop[m]:
                work += chips[m] * need
            else:
                unit = units[m]
                end, gained, i = _advance(unit, cursors[m], start, need)
                if end is None:
                    return RoundsResult(rounds, done_wall, done_work)
                work += gained
                cursors[m] = i
                begin[m], stop[m], chips[m] = unit.starts[i], unit.ends[i], unit.running[i]
            if end > finish:
                finish = end
        rounds += 1
        start = finish + tm.diloco_sync_seconds
        done_wall, done_work = start, done_work + work


def _draw_needs(noise: np.random.Generator, compute: float, cv: float, learners: int) -> list[list[float]]:
    if cv <= 0:
        return [[compute] * learners] * _CHUNK
    shape = 1.0 / cv**2
    return noise.gamma(shape, compute / shape, size=(_CHUNK, learners)).tolist()


def _advance(unit: UnitRun, i: int, start: float, need: float):
    """Walk unit's computing intervals from `start` until `need` seconds of computing are done.

    Returns (finish time or None past the horizon, chip-seconds computed, next interval index).
    """
    starts, ends, running = unit.starts, unit.ends, unit.running
    n = len(ends)
    while i < n and ends[i] <= start:
        i += 1
    now, work = start, 0.0
    while i < n:
        begin = starts[i] if starts[i] > now else now
        available = ends[i] - begin
        if available >= need:
            return begin + need, work + running[i] * need, i
        work += running[i] * available
        need -= available
        now = ends[i]
        i += 1
    return None, work, i
