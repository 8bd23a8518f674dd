"""The syncer's outer optimizer: SGD with Nesterov momentum on outer gradients (DESIGN §3.4)."""

from __future__ import annotations

import torch


def nesterov_step(theta: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor, lr: float, mu: float) -> None:
    """In place: v ← μ·v + Δ ; Θ ← Θ − η·(Δ + μ·v). Δ points from the new local model back to the base."""
    momentum.mul_(mu).add_(delta)
    theta.sub_(delta.add(momentum, alpha=mu), alpha=lr)
