"""The syncer's outer optimizer: SGD with Nesterov momentum on outer gradients (docs/algorithm.md §4)."""

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


def outer_update(theta: torch.Tensor, delta: torch.Tensor, cfg, momentum: torch.Tensor | None,
                 pending: torch.Tensor | None, share: float, pending_share: float, final: bool = False) -> float:
    """One round's outer step on a parameter fragment's Θ, in place, under `cfg` (a SyncConfig); `delta` is the
    round's merged Δ, already scaled by its `share` of the expected tokens, and may be overwritten. Returns the new
    pending share (the delayed forms' count of rounds since the momentum last advanced).

    μ = 0: the plain step Θ ← Θ − η·Δ (no momentum kept). `final` (a round of learners' last pushes): the plain
    step −η·Δ/N, momentum and pending sum left as they are. Delayed forms (`delayed_momentum`, `momentum_every` N >
    1): Δ/N joins the pending sum, counted as share/N (or 1/N), and the momentum advances once it reaches 1.
    Otherwise Nesterov on every round."""
    every = cfg.momentum_every
    if not cfg.keeps_outer_state:
        theta.sub_(delta, alpha=cfg.outer_lr)
        return pending_share
    if final:
        theta.sub_(delta, alpha=cfg.outer_lr / every)
        return pending_share
    if cfg.delayed_momentum or every > 1:
        if every > 1:  # N rounds then move Θ as one synchronous round of their mean Δ
            delta.div_(every)
        counts = (share if cfg.delayed_momentum else 1.0) / every
        return delayed_nesterov_step(theta, delta, momentum, pending, counts, pending_share, cfg.outer_lr,
                                     cfg.outer_momentum)
    nesterov_step(theta, delta, momentum, cfg.outer_lr, cfg.outer_momentum)
    return pending_share
