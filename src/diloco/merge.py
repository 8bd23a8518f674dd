"""Token-weighted merging of learners' outer gradients (DESIGN §3.4).

Embedding tensors use the weighted mean; all others radial-directional averaging (RDA): the merged direction is
the weighted mean of unit directions and the merged norm the weighted mean of norms, so nearly orthogonal
contributions from many learners do not shrink the step.
"""

from __future__ import annotations

import torch

_EPS = 1e-12


def token_weight(tokens: int, steps: int, staleness: int = 0, staleness_decay: float = 0.0) -> float:
    """w = tokens² / steps (tokens processed × tokens per step), divided by (1 + λ·staleness)."""
    if steps <= 0 or tokens <= 0:
        return 0.0
    return tokens * tokens / steps / (1.0 + staleness_decay * staleness)


def weighted_mean(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w_m Δ_m / Σ w_m over the rows of `deltas`."""
    w = weights / weights.sum()
    return (w[:, None] * deltas).sum(dim=0)


def rda(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Radial-directional average of the rows of `deltas`; falls back to the mean if directions cancel."""
    w = weights / weights.sum()
    norms = deltas.norm(dim=1)
    units = deltas / torch.where(norms > _EPS, norms, torch.ones_like(norms))[:, None]
    units[norms <= _EPS] = 0.0
    direction = (w[:, None] * units).sum(dim=0)
    length = direction.norm()
    if length <= 1e-6:
        return weighted_mean(deltas, weights)
    return (w * norms).sum() * direction / length


def merge(deltas: list[torch.Tensor], weights: list[float], segments: list[tuple[int, bool]], method: str = "rda") -> torch.Tensor:
    """Merge flat fragment deltas; `segments` lists (elements, is-embedding) per tensor in payload order.

    `method="mean"` uses the weighted mean for every tensor (synchronous DiLoCo's plain averaging).
    """
    if method not in ("rda", "mean"):
        raise ValueError(f"unknown merge method {method!r}; choose rda or mean")
    if not deltas:
        raise ValueError("nothing to merge")
    if len(deltas) == 1:
        return deltas[0].clone()  # both rules are the identity for one contribution; skip their rounding
    w = torch.tensor(weights, dtype=torch.float32)
    if not torch.all(w >= 0) or w.sum() <= 0:
        w = torch.ones_like(w)  # no usable token counts: treat contributions equally
    stacked = torch.stack(deltas)
    out = torch.empty_like(deltas[0])
    offset = 0
    for numel, embedding in segments:
        part = stacked[:, offset : offset + numel]
        rule = weighted_mean if embedding or method == "mean" else rda
        out[offset : offset + numel] = rule(part, w)
        offset += numel
    return out
