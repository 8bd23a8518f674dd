"""The outlier defence: which contributions are too large to merge, and how far a large one is clipped, judged by
their norm per local step (declared steps counted up to H: declaring more buys no larger allowance).

- **Ceiling**, from a run's first push: at most `norm_ceiling` × the fragment's own norm per step (√n·NEAR_ZERO_RMS
  for a fragment near zero). An honest AdamW step moves each value by about the learning rate, so a step's Δ
  relative to the fragment is about lr / rms(θ): 0.003–0.11 for GPT-2-style models at lr 6e-4–1e-2
  (benchmarks/LOG.md).
- **Population**: at most `max_norm_ratio` × the reference of the fragment's accepted contributions, once
  MIN_SAMPLES of them are known. The reference is per credential (syncer/defences/reference.py): the median over *other*
  credentials of their recent medians, so neither many ids of one party nor a party's own history move it.
  Refused and zero-norm contributions never feed it. When most credentials pushing a fragment (two at least)
  exceed it together, the honest population has moved (an unfrozen body, a learning-rate jump): their norms
  become the new reference instead of being refused forever.
- **Clip** (`clip_norm_ratio`, the robust merge): a contribution over `clip_norm_ratio` × the others' reference is
  scaled down to it before it is merged, not refused. While fewer than MIN_OTHERS other credentials have
  history, a prior from the fragment's own norm (PRIOR_PER_STEP of it per step) joins the reference, so the
  first pushes of a run are bounded too.
"""

from __future__ import annotations

import math
import statistics

from diloco.syncer.defences.reference import PerCredential

MIN_SAMPLES = 4
"""Accepted contributions before the population bound applies (the ceiling applies from the first)."""
NEAR_ZERO_RMS = 0.02
"""Per-value scale the ceiling assumes for a fragment whose own norm is smaller (zero-initialised layers)."""
PRIOR_PER_STEP = 0.05
"""The clip's prior: a typical step's norm relative to its fragment's before any is known (0.003–0.11 measured; at
the default ratio, 2, the first pushes are bounded at 0.1 of it: an honest step that large is scaled down a
little, never refused)."""
MIN_OTHERS = 2
"""Other credentials with history before the clip's reference is theirs alone (the prior no longer joins it)."""


def fragment_scale(numel: int, fragment_norm: float) -> float:
    """The norm bounds are relative to: the fragment's own norm, or √n·NEAR_ZERO_RMS for one near zero."""
    return max(fragment_norm, math.sqrt(numel) * NEAR_ZERO_RMS)


class NormGuard:
    """The outlier bounds of one fragment. Not thread-safe: the syncer calls it under its lock."""

    def __init__(self, numel: int, ceiling: float, ratio: float, sync_every: int, clip: float = 0.0):
        self.numel, self.ceiling, self.ratio, self.clip = numel, ceiling, ratio, clip
        self.max_steps = max(1, sync_every)
        self.accepted = PerCredential()
        self.outliers: dict[str, float] = {}
        """Credentials whose latest contribution exceeded the population bound, with its norm per step."""

    def per_step(self, norm: float, steps: int) -> float:
        return norm / min(max(steps, 1), self.max_steps)

    def scale(self, fragment_norm: float) -> float:
        return fragment_scale(self.numel, fragment_norm)

    def judge(self, credential: str, per_step: float, fragment_norm: float) -> str | None:
        """Why the contribution is refused ("norm ...: details"), or None if it may be merged."""
        if self.ceiling:
            limit = self.ceiling * self.scale(fragment_norm)
            if per_step > limit:
                return (f"norm over ceiling: {per_step:.3g} per step is over {self.ceiling:g}× the fragment's own "
                        f"norm ({limit:.3g})")
        if not self.ratio or self.accepted.samples() < MIN_SAMPLES:
            return None
        others = self.accepted.reference(credential)
        typical = others if others is not None else self.accepted.reference()  # alone: its own history
        if per_step <= self.ratio * typical:
            return None
        self.outliers[credential] = per_step
        population = self.accepted.credentials() | set(self.outliers)
        if len(self.outliers) >= 2 and 2 * len(self.outliers) > len(population):
            # most credentials moved together: the reference moves with them
            self.accepted = PerCredential()
            for who, norm in self.outliers.items():
                if who != credential:
                    self.accepted.add(who, norm)
            self.outliers.clear()
            return None
        return (f"norm outlier: {per_step:.3g} per step is over {self.ratio:g}× the typical {typical:.3g} of "
                f"other learners' accepted contributions")

    def clip_bound(self, credential: str, fragment_norm: float) -> float | None:
        """The largest norm per step a contribution of `credential` is merged with (larger ones are scaled down to
        it); None when clipping is off."""
        if not self.clip:
            return None
        medians = self.accepted.medians(credential)
        if len(medians) < MIN_OTHERS:
            medians.append(PRIOR_PER_STEP * self.scale(fragment_norm))
        return self.clip * statistics.median(medians)

    def accept(self, credential: str, per_step: float) -> None:
        """Called once the contribution (clipped) is merged into its round (after every other check)."""
        self.outliers.pop(credential, None)
        if per_step > 0:
            self.accepted.add(credential, per_step)
