"""Event-driven simulation of one unit: a group of slices trained as one job.

A unit is the whole cluster for data-parallel training, or one learner for DiLoCo. While it computes, its
running chips fail as one Poisson process (rate = running chips / MTBI), so the cost is one random draw per
failure, not per chip: O(chips x simulated time / MTBI) events. Each failure takes a slice out for
`repair_seconds`; repaired slices rejoin at the end of the next pause, or after `grow_wait_seconds` through a
pause of their own. The elastic unit pauses briefly to shrink and grow; the non-elastic one restarts from its
last checkpoint.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from diloco.sim.world import FailureModel, young_daly_interval


@dataclass
class UnitRun:
    """What happened to one unit over the simulated horizon."""

    chips: float
    """Chips allocated to the unit."""

    horizon: float
    """Simulated seconds."""

    work: float = 0.0
    """Useful chip-seconds: computing whose result was kept."""

    up_seconds: float = 0.0
    """Seconds during which the unit computed work that was kept."""

    failures: int = 0
    """Failures counted (that took a slice out)."""

    exposure: float = 0.0
    """Chip-seconds during which chips could fail (the failure process's clock)."""

    starts: list[float] = field(default_factory=list)
    """Start of each computing interval (recorded on request)."""

    ends: list[float] = field(default_factory=list)
    """End of each computing interval."""

    running: list[float] = field(default_factory=list)
    """Chips computing during each interval."""

    @property
    def goodput(self) -> float:
        return self.work / (self.chips * self.horizon)


def checkpoint_interval(chips: float, fm: FailureModel) -> float:
    if fm.checkpoint_interval_seconds is not None:
        return fm.checkpoint_interval_seconds
    # Failures do not strike during a restart here, so the restart time does not enter Daly's formula.
    return young_daly_interval(fm.checkpoint_seconds, fm.mtbi_seconds / chips)


def simulate_unit(chips: float, fm: FailureModel, horizon: float, rng: random.Random, *,
                  elastic: bool, record: bool = False) -> UnitRun:
    """Simulate one unit of `chips` chips for `horizon` seconds."""
    if chips < fm.slice_chips:
        raise ValueError(f"a unit of {chips:g} chips is smaller than one slice ({fm.slice_chips} chips)")
    run = UnitRun(chips=chips, horizon=horizon)
    uniform, log = rng.random, math.log
    mtbi, s, repair, wait = fm.mtbi_seconds, fm.slice_chips, fm.repair_seconds, fm.grow_wait_seconds
    if elastic:
        after_failure, after_grow = fm.shrink_seconds, fm.grow_seconds
        interval = segment = math.inf
    else:
        after_failure = fm.restart_seconds
        after_grow = fm.checkpoint_seconds + fm.planned_restart_seconds
        interval = checkpoint_interval(chips, fm)
        segment = interval + fm.checkpoint_seconds
    repairs: deque[float] = deque()  # completion times; FIFO because repair time is constant
    down = failures = 0
    t = work = up = exposure = 0.0
    while True:
        running = chips - down * s
        if running > 0:
            t_fail = t - log(1.0 - uniform()) * mtbi / running
            t_grow = repairs[0] + wait if repairs else math.inf
        else:
            running = 0.0
            t_fail = math.inf
            t_grow = repairs[0]  # nothing computes: no reason to wait
        if t_grow < t:
            t_grow = t
        failed = t_fail <= t_grow
        t_next = t_fail if failed else t_grow
        if t_next > horizon:
            t_next = horizon
        span = t_next - t
        exposure += running * span
        kept = span
        if segment < math.inf:
            whole = int(span // segment)
            rest = span - whole * segment
            # A failure loses the unfinished segment; a planned stop checkpoints it first.
            kept = whole * interval + (0.0 if failed and t_next < horizon else min(rest, interval))
        if running > 0 and span > 0:
            work += running * kept
            up += kept
            if record:
                run.starts.append(t)
                run.ends.append(t_next)
                run.running.append(running)
        if t_next >= horizon:
            break
        if failed:
            failures += 1
            down += 1
            repairs.append(t_next + repair)
            end = t_next + after_failure
        else:
            end = t_next + after_grow
        if fm.failures_in_pauses:
            end, down, extra, extra_exposure = _failures_during_pause(fm, chips, down, repairs, t_next, end,
                                                                     after_failure, rng)
            failures += extra
            exposure += extra_exposure
        while repairs and repairs[0] <= end:
            repairs.popleft()
            down -= 1
        if end >= horizon:
            break
        t = end
    run.work, run.up_seconds, run.failures, run.exposure = work, up, failures, exposure
    return run


def _failures_during_pause(fm: FailureModel, chips: float, down: int, repairs: deque, start: float,
                           end: float, after_failure: float, rng: random.Random):
    """Optional: chips also fail while paused; each failure takes its slice out and extends the pause.

    Returns (new end of the pause, slices down, failures counted, chip-seconds exposed).
    """
    t, failures, exposure = start, 0, 0.0
    while True:
        up = max(chips - down * fm.slice_chips, 0.0)
        t_fail = t + rng.expovariate(up / fm.mtbi_seconds) if up > 0 else math.inf
        if t_fail >= end:
            return end, down, failures, exposure + up * (end - t)
        exposure += up * (t_fail - t)
        failures += 1
        down += 1
        repairs.append(t_fail + fm.repair_seconds)
        end = max(end, t_fail + after_failure)
        t = t_fail
