"""The agreement test (`SyncConfig.agreement_floor`): every contribution of a round against the round's other
contributions, which arrived for the same version of the same fragment at about the same time.

The direction test (defences/direction_guard.py) judges a credential by its recent median against the fragment's
past steps. It leaves two openings: a fragment's first rounds, before its reference is ready, and a credential
that turns against the run on fewer than half of its pushes. Both are visible inside one round: honest learners'
steps of the same fragment from the same version agree with one another, whoever arrived first, and they agree
even on fragments whose consecutive merged steps alternate in sign, where every learner turns at once.

- **Sketch**: at arrival each contribution's Δ is summed into SKETCH values, row by row of a SKETCH-wide view with a
  fixed random sign per row (a count sketch whose buckets are the columns): inner products of sketches estimate
  those of the Δs within about 1/√SKETCH of their norms' product. Only cosines are asked of a sketch, so it is kept
  as its direction in int8 (SKETCH bytes, its largest value ±127): a round holds one per contribution and the
  fragment one per credential of its last rounds, which is what the test costs per learner (4 KiB a fragment
  each, against 16 KiB in fp32); rounding moves a cosine by about 1e-4, against the sketch's own 1/64.
- **Score**: cosine of its sketch with each contribution of another credential in the round, and with the latest
  contribution of each other credential in the fragment's last PEER_ROUNDS rounds (a round that closed on its
  first contribution has others too); the score is the ⌈n/2⌉-th largest of those n cosines, one per credential:
  it agrees with at least half of the others. Judged only when three credentials or more are there (two can only
  disagree).
- **Factor**: its score over `floor` × the median of the other credentials' scores, at most 1 and at least 0; its Δ
  and weight are merged times it (with the direction test's factor, when both judge it). Everything passes while
  that median is under MIN_TYPICAL: the others do not agree among themselves, so there is nothing to agree with.
- **Cost**: when every factor is 1, nothing but the sketches. Otherwise the round's sums are made anew from the
  contributions' payloads as they arrived (kept encoded: an int4 payload is an eighth of the fragment), each
  decoded and scaled once more.
"""

from __future__ import annotations

import math
import statistics

import torch

SKETCH = 4096
"""Values per sketch: the estimate of a cosine is within about 1/64 of the true one (one standard deviation)."""
MIN_CREDENTIALS = 3
PEER_ROUNDS = 2
"""Closed rounds of the fragment whose contributions of other credentials a round's contributions are judged against
too (the latest of each credential): a round of one or two has others to agree with."""
MIN_TYPICAL = 0.05
"""The others' median score below which nothing is judged: honest steps that agree this little leave no direction
to hold a contribution to."""
_SIGNS: dict[int, torch.Tensor] = {}


def _signs(rows: int) -> torch.Tensor:
    """Fixed random ±1 per row (the same in every process, so sketches of one fragment compare)."""
    signs = _SIGNS.get(rows)
    if signs is None:
        generator = torch.Generator().manual_seed(rows)
        signs = torch.randint(0, 2, (rows,), generator=generator).float().mul_(2).sub_(1)
        _SIGNS[rows] = signs
    return signs


def sketch(delta: torch.Tensor) -> torch.Tensor:
    """A SKETCH-value summary of `delta` (fp32, flat) whose cosines estimate `delta`'s: int8, its largest value
    ±127 (all zeros for a Δ of zeros, or one that is not finite: it agrees with nothing)."""
    n = delta.numel()
    rows, tail = divmod(n, SKETCH)
    out = torch.zeros(SKETCH)
    if rows:
        out.add_(_signs(rows + 1)[:rows] @ delta[: rows * SKETCH].view(rows, SKETCH))
    if tail:
        out[:tail].add_(delta[rows * SKETCH :], alpha=_signs(rows + 1)[rows].item())
    peak = out.abs().max().item()
    if not 0 < peak < math.inf:
        return torch.zeros(SKETCH, dtype=torch.int8)
    return out.mul_(127 / peak).round_().to(torch.int8)


def cosines(sketches: list[torch.Tensor]) -> torch.Tensor:
    """Every pair's cosine, from sketches none of which is all zeros."""
    stacked = torch.stack(sketches).float()
    units = stacked / torch.linalg.vector_norm(stacked, dim=1, keepdim=True)
    return units @ units.T


def judge(credentials: list[str], sketches: list[torch.Tensor | None], floor: float,
          judged: int | None = None) -> list[tuple[float, float | None]]:
    """(factor, score) of each of the first `judged` contributions (all by default) given every contribution's
    credential and sketch (None: no sketch, judged by nothing here); those after `judged` (the previous round's)
    are only others to agree with. Several contributions of one credential count as one voice: the median of their
    cosines."""
    judged = len(credentials) if judged is None else judged
    verdicts: list[tuple[float, float | None]] = [(1.0, None)] * judged
    present = [i for i in range(len(credentials)) if sketches[i] is not None and bool(sketches[i].any())]
    if len({credentials[i] for i in present}) < MIN_CREDENTIALS:
        return verdicts
    cosine = cosines([sketches[i] for i in present]).tolist()
    scores: dict[int, float] = {}
    for a, i in enumerate(present):
        others = sorted(_voices(credentials[i], ((credentials[j], cosine[a][b]) for b, j in enumerate(present))),
                        reverse=True)
        scores[i] = others[math.ceil(len(others) / 2) - 1]
    for i, score in scores.items():
        if i >= judged:
            continue
        typical = statistics.median(_voices(credentials[i], ((credentials[j], s) for j, s in scores.items())))
        factor = 1.0 if typical < MIN_TYPICAL else min(1.0, max(0.0, score) / (floor * typical))
        verdicts[i] = (factor, score)
    return verdicts


def _voices(credential: str, values) -> list[float]:
    """The median value of each credential other than `credential`, from (credential, value) pairs."""
    by_credential: dict[str, list[float]] = {}
    for other, value in values:
        if other != credential:
            by_credential.setdefault(other, []).append(value)
    return [statistics.median(v) for v in by_credential.values()]
