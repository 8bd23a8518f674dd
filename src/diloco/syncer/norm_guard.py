"""The outlier defence: which contributions are too large to merge, judged by their norm per local step.

Two bounds, both on ‖Δ‖ / steps with the declared steps capped at STEPS_CAP·H (declaring more steps buys a
larger allowance only up to that cap):

- **Ceiling**, from a run's first push: at most `norm_ceiling` × the fragment's own norm (√n·NEAR_ZERO_RMS for a
  fragment near zero). An honest AdamW step moves each value by about the learning rate, so a step's Δ relative to
  the fragment is about lr / rms(θ): 0.003–0.11 for GPT-2-style models at lr 6e-4–1e-2 (docs/results.md).
- **Population**: at most `max_norm_ratio` × the median of recent *accepted* contributions of the fragment, once
  MIN_SAMPLES of them are known. Refused contributions never feed it, zero-norm ones (a frozen phase) neither, so
  it can be neither inflated by an attacker's refused pushes nor collapsed to zero. When most of the learners
  pushing a fragment (two at least) exceed it, the honest population has moved (an unfrozen body, a learning-rate
  jump): their norms become the new reference instead of being refused forever.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

HISTORY = 32
"""Accepted contributions per fragment that the population bound is judged against."""
MIN_SAMPLES = 4
"""Accepted contributions before the population bound applies (the ceiling applies from the first)."""
STEPS_CAP = 2
"""Declared steps count up to this multiple of H when a norm is divided by them."""
NEAR_ZERO_RMS = 0.02
"""Per-value scale the ceiling assumes for a fragment whose own norm is smaller (zero-initialised layers)."""


class NormGuard:
    """The outlier bounds of one fragment. Not thread-safe: the syncer calls it under its lock."""

    def __init__(self, numel: int, ceiling: float, ratio: float, sync_every: int):
        self.numel, self.ceiling, self.ratio = numel, ceiling, ratio
        self.max_steps = max(1, STEPS_CAP * sync_every)
        self.accepted: deque[tuple[str, float]] = deque(maxlen=HISTORY)
        self.outliers: dict[str, float] = {}
        """Learners whose latest contribution exceeded the population bound, with its norm per step."""

    def per_step(self, norm: float, steps: int) -> float:
        return norm / min(max(steps, 1), self.max_steps)

    def judge(self, learner: str, per_step: float, fragment_norm: float) -> str | None:
        """Why the contribution is refused ("norm ...: details"), or None if it may be merged."""
        if self.ceiling:
            limit = self.ceiling * max(fragment_norm, math.sqrt(self.numel) * NEAR_ZERO_RMS)
            if per_step > limit:
                return (f"norm over ceiling: {per_step:.3g} per step is over {self.ceiling:g}× the fragment's own "
                        f"norm ({limit:.3g})")
        if not self.ratio or len(self.accepted) < MIN_SAMPLES:
            return None
        typical = statistics.median(norm for _, norm in self.accepted)
        if per_step <= self.ratio * typical:
            return None
        self.outliers[learner] = per_step
        population = {who for who, _ in self.accepted} | set(self.outliers)
        if len(self.outliers) >= 2 and 2 * len(self.outliers) > len(population):
            # most learners moved together: the reference moves with them
            self.accepted.clear()
            self.accepted.extend((who, norm) for who, norm in self.outliers.items() if who != learner)
            self.outliers.clear()
            return None
        return (f"norm outlier: {per_step:.3g} per step is over {self.ratio:g}× the recent median {typical:.3g} of "
                f"accepted contributions")

    def accept(self, learner: str, per_step: float) -> None:
        """Called once the contribution is merged into its round (after every other check)."""
        self.outliers.pop(learner, None)
        if per_step > 0:
            self.accepted.append((learner, per_step))
