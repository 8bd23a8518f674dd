"""Syncer cores in memory, under a clock set by hand: what the tests of rounds, defences and the state share."""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco.algorithm import codec
from diloco.algorithm.fragments import TensorSpec, plan_fragments
from diloco.config import for_mode
from diloco.syncer.core import SyncerCore
from fakes import Clock

SPECS = [TensorSpec("emb", (4, 2), "float32", True), TensorSpec("w1", (3, 2), "float32"), TensorSpec("w2", (5,), "float32")]
"""A toy model: 8 + 6 + 5 values, one tensor per fragment at P = 3."""


def arange(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def linspace(n: int) -> torch.Tensor:
    return torch.linspace(-1, 1, n)


def core_in_memory(learners: int, specs=SPECS, values: Callable[[int], torch.Tensor] = arange, fragments: int = 3,
                   **settings) -> tuple[SyncerCore, Clock]:
    """A decoupled SyncerCore of `learners` over `specs` in `fragments` fragments, each fragment's values
    `values(numel)`, `settings` over the decoupled defaults, and the clock it reads. Verbatim replays are accepted
    unless `settings` says otherwise: these tests push the same constant Δ again and again, which no learner does
    (tests/unit/test_replayed_pushes.py tests the refusal)."""
    clock = Clock()
    settings = {"refuse_replays": False, **settings}
    core = SyncerCore(for_mode("decoupled", learners, fragments=fragments, **settings), clock=clock)
    core.initialize(specs, [values(f.numel) for f in plan_fragments(specs, fragments)])
    return core, clock


def make_core(learners=2, specs=SPECS, **overrides):
    """The rounds tests' core: H = 6, fp32 pushes, no clip (their unit-sized Δs would be rescaled by it)."""
    return core_in_memory(learners, specs, sync_every=6, codec="fp32", **{"clip_norm_ratio": 0.0, **overrides})


def push(core, lid, session, seq, fragment=1, value=0.5, base_version=None, steps=4, tokens=400):
    """Push Δ = `value` everywhere in `fragment`, on its current version unless `base_version` is given."""
    n = core.fragments[fragment].fragment.numel
    payload = codec.encode(torch.full((n,), value), "fp32")
    base = core.fragments[fragment].version if base_version is None else base_version
    return core.push(lid, session, seq, fragment, base, steps, tokens, payload)


class Steps:
    """Outer gradients of one fragment: a shared direction g, each honest one g plus its own noise (cosine about 0.8
    with g), as real learners' outer gradients share the descent."""

    def __init__(self, n: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.g = torch.randn(n, generator=self.gen)

    def honest(self) -> torch.Tensor:
        return 0.01 * (self.g + 0.7 * torch.randn(self.g.numel(), generator=self.gen))

    def noise(self) -> torch.Tensor:
        d = torch.randn(self.g.numel(), generator=self.gen)
        return d * (self.honest().norm() / d.norm())
