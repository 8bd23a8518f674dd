"""Time the goodput simulator: the full published sweep, and how cost grows with chips and simulated time.

    python -m benchmarks.links.sim_sweep
"""

from __future__ import annotations

import os
import time

from diloco.sim.presets import PAPER_AGGRESSIVE
from diloco.sim.sweep import Cell, cells_for, run_cell, run_sweep

DAY = 86400.0
CHIPS = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    fm, tm = PAPER_AGGRESSIVE.failures, PAPER_AGGRESSIVE.training
    cells = cells_for(["dp", "dp-elastic", "diloco", "decoupled"], CHIPS, [8, 16])
    print(f"full sweep: {len(cells)} cells, 3 simulated days x 5 runs")
    for jobs in sorted({1, os.cpu_count() or 1}):
        wall, cpu = _timed(lambda: run_sweep(cells, fm, tm, 3 * DAY, 5, seed=0, jobs=jobs))
        print(f"  jobs={jobs}: {wall:5.2f} s wall, {cpu:5.2f} s CPU in this process")
    print("one cell, 5 runs, best of 3 (seconds): cost grows with chips x simulated days")
    columns = {"dp": ("dp", 1), "dp-elastic": ("dp-elastic", 1), "diloco-8": ("diloco", 8),
               "decoupled-8": ("decoupled", 8)}
    print(f"  {'chips':>9} {'days':>4} " + " ".join(f"{n:>12}" for n in columns))
    for chips, days in [(c, 5) for c in CHIPS] + [(1_200_000, d) for d in (10, 20)]:
        times = []
        for strategy, learners in columns.values():
            cell = Cell(strategy, chips, learners)
            times.append(min(_timed(lambda: run_cell(cell, fm, tm, days * DAY, 5, seed=0))[0] for _ in range(3)))
        print(f"  {chips:>9,} {days:>4} " + " ".join(f"{t:12.3f}" for t in times))


if __name__ == "__main__":
    main()
