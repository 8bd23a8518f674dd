"""Sweeps over (strategy, chips, learners) cells with repeated, independently seeded runs."""

from __future__ import annotations

import math
import multiprocessing
import random
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable

import numpy as np

from diloco.sim.world import FailureModel, TrainingModel
from diloco.sim.strategies import MULTI_LEARNER, STRATEGIES, simulate

# Two-sided 95% Student t quantiles by degrees of freedom (a standard table; above 30 the normal's 1.96).
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


@dataclass(frozen=True)
class Cell:
    """One (strategy, chips, learners) point of a sweep."""

    strategy: str
    """dp, dp-elastic, diloco or decoupled."""

    chips: int
    """Chips allocated in total."""

    learners: int
    """Learners (1 for the data-parallel strategies)."""


@dataclass(frozen=True)
class CellResult:
    """Mean and 95% confidence half-width over repeated runs of one cell."""

    cell: Cell
    """Which cell."""

    goodput: float
    """Mean goodput (0..1)."""

    goodput_ci: float
    """95% confidence half-width of the goodput (0 with one repeat)."""

    uptime: float
    """Mean uptime (0..1)."""

    uptime_ci: float
    """95% confidence half-width of the uptime."""

    failures: float
    """Mean number of failures counted per run."""

    repeats: int
    """Independent runs averaged."""


def cells_for(strategies: list[str], chips: list[int], learners: list[int]) -> list[Cell]:
    """The sweep's cells: data-parallel strategies once per chip count, the others once per learner count."""
    out = []
    for n in chips:
        for strategy in strategies:
            counts = learners if strategy in MULTI_LEARNER else [1]
            out.extend(Cell(strategy, n, m) for m in counts)
    return out


def cell_seed(seed: int, cell: Cell, repeat: int) -> int:
    """A seed that depends only on the cell and the repeat, so results do not depend on sweep order."""
    entropy = [seed, STRATEGIES.index(cell.strategy), cell.chips, cell.learners, repeat]
    return int(np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint64)[0])


def run_cell(cell: Cell, fm: FailureModel, tm: TrainingModel, horizon: float, repeats: int,
             seed: int) -> CellResult:
    samples = [simulate(cell.strategy, cell.chips, cell.learners, fm, tm, horizon,
                        random.Random(cell_seed(seed, cell, r)))
               for r in range(repeats)]
    goodput, goodput_ci = mean_ci([s.goodput for s in samples])
    uptime, uptime_ci = mean_ci([s.uptime for s in samples])
    return CellResult(cell, goodput, goodput_ci, uptime, uptime_ci,
                      statistics.fmean(s.failures for s in samples), repeats)


def run_sweep(cells: list[Cell], fm: FailureModel, tm: TrainingModel, horizon: float, repeats: int,
              seed: int, on_cell: Callable[[CellResult], None] | None = None, jobs: int = 1) -> list[CellResult]:
    """Run every cell; with jobs > 1 cells run in worker processes (results do not depend on jobs)."""
    if jobs <= 1 or len(cells) <= 1:
        results = []
        for cell in cells:
            results.append(run_cell(cell, fm, tm, horizon, repeats, seed))
            if on_cell:
                on_cell(results[-1])
        return results
    by_cell: dict[Cell, CellResult] = {}
    # Most expensive cells first so the workers finish together.
    order = sorted(cells, key=lambda c: -c.chips * (c.learners if c.strategy == "diloco" else 1))
    # spawn, not fork: forking a process that already runs threads (gRPC, a syncer, a caller's own) can deadlock
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_cell, cell, fm, tm, horizon, repeats, seed) for cell in order]
        for future in as_completed(futures):
            result = future.result()
            by_cell[result.cell] = result
            if on_cell:
                on_cell(result)
    return [by_cell[cell] for cell in cells]


def expected_events(cells: list[Cell], fm: FailureModel, tm: TrainingModel, horizon: float,
                    repeats: int) -> float:
    """Rough count of simulation events (failures and outer rounds), to predict the run time."""
    failures = sum(c.chips for c in cells) * horizon / fm.mtbi_seconds
    rounds = sum(c.learners for c in cells if c.strategy == "diloco") * horizon / (
        tm.sync_every * tm.step_seconds)
    return (2 * failures + rounds) * repeats


def mean_ci(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    df = len(values) - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))
