"""The syncer's outer optimizer: SGD with Nesterov momentum on outer gradients (DESIGN §3.4)."""

from __future__ import annotations

import torch


def nesterov_step(theta: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor, lr: float, mu: float) -> None:
    """In place: v ← μ·v + Δ ; Θ ← Θ − η·(Δ + μ·v). Δ points from the new local model back to the base."""
    momentum.mul_(mu).add_(delta)
    theta.sub_(delta.add(momentum, alpha=mu), alpha=lr)


def delayed_nesterov_step(theta: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor, pending: torch.Tensor,
                          share: float, pending_share: float, lr: float, mu: float) -> float:
    """Nesterov whose momentum advances once per full round's worth of contributions (share 1).

    A partial round (share < 1, already scaled by its share) moves Θ by a plain step −η·Δ and joins `pending`;
    once the pending shares reach 1, v ← μ·v + Σpending and Θ takes the look-ahead −η·μ·v. With share 1 every
    round this is exactly `nesterov_step`. Updating momentum on every stale, partial round instead makes
    asynchronous training diverge. Returns the new pending share.
    """
    if share >= 1.0 and pending_share == 0.0:
        nesterov_step(theta, delta, momentum, lr, mu)
        return 0.0
    theta.sub_(delta, alpha=lr)
    pending.add_(delta)
    pending_share += share
    if pending_share >= 1.0 - 1e-9:
        momentum.mul_(mu).add_(pending)
        theta.sub_(momentum, alpha=lr * mu)
        pending.zero_()
        pending_share = 0.0
    return pending_share
