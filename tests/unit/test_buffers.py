"""Reused fragment buffers: bounded, and the syncer's hot path takes and returns them without mixing contents."""

import torch

from diloco.algorithm import codec
from diloco.syncer.buffers import Buffers
from cores import SPECS, make_core


def test_buffers_are_reused_up_to_the_limit():
    b = Buffers(limit_bytes=3 * 400)
    x, y = b.take(100), b.take(100)
    b.give(x)
    assert b.take(100) is x  # the same memory again, no fresh allocation
    b.give(x), b.give(y)
    big = torch.empty(300)
    b.give(big)  # 800 + 1200 bytes would exceed the limit: released instead
    assert b.kept_bytes == 800 and b.take(300) is not big
    b.give(x[:50])  # a view of something else: never kept
    assert b.kept_bytes == 800


def test_rounds_return_their_buffers_and_results_stay_exact():
    core, _ = make_core(learners=2, grace=0.0, quorum=2, bf16_residual=False)  # Θ in fp32: exact to float rounding
    sessions = {lid: core.join(lid, SPECS) for lid in "ab"}
    n = core.fragments[1].fragment.numel
    g = torch.Generator().manual_seed(0)
    for seq in range(1, 6):
        deltas = {lid: torch.randn(n, generator=g) for lid in "ab"}
        before = core.fragments[1].outer_values().clone()
        for lid, d in deltas.items():
            assert core.push(lid, sessions[lid], seq, 1, core.fragments[1].version, 4, 400, codec.encode(d, "fp32")).accepted
        assert core.poll()
        # decoupled defaults: RDA of two equal-weight contributions, outer η = 1, μ = 0
        units = [d / d.norm() for d in deltas.values()]
        direction = (units[0] + units[1]) / 2
        expected = (deltas["a"].norm() + deltas["b"].norm()) / 2 * direction / direction.norm()
        torch.testing.assert_close(before - core.fragments[1].outer_values(), expected, rtol=1e-5, atol=1e-6)
        assert 0 < core.buffers.kept_bytes <= core.buffers.limit_bytes  # the round's sums came back
