import math

import pytest
import torch

from diloco.algorithm import codec
from diloco.algorithm import merge as merge_module
from diloco.algorithm.merge import StreamingMerge, merge, rda, segment_norms, token_weight, weighted_mean
from diloco.algorithm.outer import nesterov_step


def test_token_weight_formula():
    assert token_weight(tokens=1000, steps=10) == 1000**2 / 10
    assert token_weight(tokens=600, steps=3) == 600**2 / 3
    assert token_weight(tokens=1000, steps=10, staleness=3, staleness_decay=0.5) == 1000**2 / 10 / 2.5
    assert token_weight(0, 5) == 0.0 and token_weight(5, 0) == 0.0


def test_weighted_mean_uses_weights_exactly():
    d = torch.tensor([[1.0, 0.0], [0.0, 4.0]])
    out = weighted_mean(d, torch.tensor([3.0, 1.0]))
    assert torch.allclose(out, torch.tensor([0.75, 1.0]))


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_rda_norm_of_equal_norm_orthogonal_deltas_is_independent_of_m(m):
    d = torch.eye(16)[:m] * 2.5
    out = rda(d, torch.ones(m))
    assert math.isclose(out.norm().item(), 2.5, rel_tol=1e-6)
    # the plain mean shrinks as 1/sqrt(M)
    assert math.isclose(weighted_mean(d, torch.ones(m)).norm().item(), 2.5 / math.sqrt(m), rel_tol=1e-6)


def test_rda_weights_norms_and_directions():
    d = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    out = rda(d, torch.tensor([1.0, 1.0]))
    assert math.isclose(out.norm().item(), 2.0, rel_tol=1e-6)  # mean of norms
    assert torch.allclose(out / out.norm(), torch.tensor([1.0, 1.0]) / math.sqrt(2))


def test_rda_falls_back_to_mean_when_directions_cancel():
    d = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])
    assert torch.allclose(rda(d, torch.ones(2)), torch.zeros(2))


def test_merge_embedding_segment_uses_mean_others_rda():
    a = torch.tensor([2.0, 0.0, 1.0, 0.0])
    b = torch.tensor([0.0, 2.0, 0.0, 1.0])
    out = merge([a, b], [1.0, 1.0], segments=[(2, True), (2, False)])
    assert torch.allclose(out[:2], torch.tensor([1.0, 1.0]))  # mean: norm shrinks
    assert math.isclose(out[2:].norm().item(), 1.0, rel_tol=1e-6)  # rda: norm kept
    mean = merge([a, b], [1.0, 1.0], segments=[(2, True), (2, False)], method="mean")
    assert torch.allclose(mean, (a + b) / 2)


def test_merge_token_weighting_end_to_end():
    a, b = torch.tensor([1.0]), torch.tensor([0.0])
    wa, wb = token_weight(300, 3), token_weight(100, 1)  # 30000 vs 10000
    out = merge([a, b], [wa, wb], segments=[(1, True)])
    assert math.isclose(out.item(), 0.75, rel_tol=1e-6)


def test_single_contribution_is_returned_exactly():
    a = torch.randn(10)
    assert torch.equal(merge([a], [5.0], segments=[(10, False)]), a)


def test_nesterov_golden_trajectory():
    # Θ0 = 1, constant Δ = 0.5, η = 0.5, μ = 0.5: every value is a dyadic rational, computed by hand:
    # v: 0.5, 0.75, 0.875, 0.9375;  Θ ← Θ − 0.5·(0.5 + 0.5·v)
    theta, v = torch.tensor([1.0]), torch.tensor([0.0])
    got = []
    for _ in range(4):
        nesterov_step(theta, torch.tensor([0.5]), v, lr=0.5, mu=0.5)
        got.append(theta.item())
    assert got == [0.625, 0.1875, -0.28125, -0.765625]  # a positive Δ moves Θ down


def test_outer_step_with_unit_lr_and_no_momentum_is_plain_update():
    theta, v = torch.tensor([1.0, -2.0]), torch.zeros(2)
    nesterov_step(theta, torch.tensor([0.25, -0.5]), v, lr=1.0, mu=0.0)
    assert torch.equal(theta, torch.tensor([0.75, -1.5]))


def test_delayed_momentum_equals_nesterov_for_full_rounds():
    from diloco.algorithm.outer import delayed_nesterov_step

    a, va = torch.tensor([1.0]), torch.zeros(1)
    b, vb, pending = torch.tensor([1.0]), torch.zeros(1), torch.zeros(1)
    share = 0.0
    for _ in range(4):
        nesterov_step(a, torch.tensor([0.5]), va, lr=0.5, mu=0.5)
        share = delayed_nesterov_step(b, torch.tensor([0.5]), vb, pending, 1.0, share, lr=0.5, mu=0.5)
    assert a.item() == b.item() == -0.765625 and share == 0.0


def test_delayed_momentum_advances_once_per_full_share():
    from diloco.algorithm.outer import delayed_nesterov_step

    theta, v, pending = torch.tensor([0.0]), torch.zeros(1), torch.zeros(1)
    share = delayed_nesterov_step(theta, torch.tensor([0.25]), v, pending, 0.5, 0.0, lr=1.0, mu=0.5)
    assert share == 0.5 and theta.item() == -0.25 and v.item() == 0.0  # plain step, momentum untouched
    share = delayed_nesterov_step(theta, torch.tensor([0.25]), v, pending, 0.5, share, lr=1.0, mu=0.5)
    # second half completes a share: v = 0.5, then the look-ahead −η·μ·v = −0.25
    assert share == 0.0 and v.item() == 0.5 and theta.item() == -0.75 and pending.item() == 0.0


class Counting:
    """Buffers for a StreamingMerge that count how many it takes."""

    taken = 0

    def take(self, numel):
        self.taken += 1
        return torch.empty(numel)

    def give(self, t):
        pass


def stream(deltas, weights, segments, method, mean_fallback=True, buffers=None, encoded=None):
    acc = StreamingMerge(segments, method, buffers, mean_fallback)
    for d, w in zip(deltas, weights):
        if encoded:  # as the syncer does: decoded from a payload, which is given along
            payload = codec.encode(d, encoded)
            acc.add(codec.decode(payload), w, payload=payload)
        else:
            acc.add(d.clone(), w)
    return acc.result()


@pytest.mark.parametrize("weights", [[3e6, 1.0, 5e5], [0.0, 2.0, 1.0], [7.0]])
def test_a_first_contribution_kept_encoded_merges_as_its_decoded_values(weights):
    g = torch.Generator().manual_seed(5)
    segments = [(300, True), (1000, False)]
    deltas = [codec.decode(codec.encode(torch.randn(1300, generator=g), "int4")) for _ in weights]
    expected = merge(deltas, weights, segments, "rda")
    got = stream(deltas, weights, segments, "rda", False, encoded="int4")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    acc = StreamingMerge(segments, "rda", None, False)
    payload = codec.encode(deltas[0], "int4")
    decoded = codec.decode(payload)
    acc.add(decoded, 1.0, payload=payload)
    assert acc.sum is None and not acc.empty  # held as its int4 payload, not as fp32 values
    assert torch.equal(acc.result(), deltas[0])


@pytest.mark.parametrize("mean_fallback", [True, False])
@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("weights", [[3e6, 1.0, 5e5, 2e5], [0.0, 2.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [7.0]])
def test_streaming_merge_equals_the_stacked_merge(method, weights, mean_fallback):
    g = torch.Generator().manual_seed(len(weights))
    segments = [(300, True), (1000, False), (7, False), (64, False)]
    deltas = [torch.randn(1371, generator=g) * (i + 1) for i in range(len(weights))]
    deltas[0][1307:] = 0.0  # a tensor that did not move in one contribution: unit(0) = 0
    expected = merge(deltas, weights, segments, method)
    got = stream(deltas, weights, segments, method, mean_fallback)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mean_fallback", [True, False])
def test_streaming_merge_of_one_contribution_is_that_contribution_exactly(mean_fallback):
    d = torch.randn(100)
    assert torch.equal(stream([d], [5.0], [(50, True), (50, False)], "rda", mean_fallback), d)


def test_streaming_merge_falls_back_to_the_mean_when_directions_cancel():
    d = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([0.5, 0.0, 0.0])]
    w = [1.0, 1.0, 1e-9]
    acc = StreamingMerge([(3, False)], "rda")
    for x, wx in zip(d, w):
        acc.add(x.clone(), wx)
    torch.testing.assert_close(acc.result(), merge(d, w, [(3, False)]), rtol=1e-5, atol=1e-7)
    assert acc.vanished == 1


def test_without_the_mean_fallback_a_vanished_direction_merges_to_zero_with_one_running_sum():
    d = [torch.tensor([1.0, 2.0, 3.0, 4.0, 1.0]), torch.tensor([-1.0, -2.0, -3.0, 2.0, 3.0])]
    segments = [(3, False), (2, True)]  # an RDA tensor whose directions cancel, then an embedding one
    buffers = Counting()  # where RDA's second running sum would come from
    acc = StreamingMerge(segments, "rda", buffers, mean_fallback=False)
    for x in d:
        acc.add(x.clone(), 1.0)
    out = acc.result()
    assert torch.equal(out[:3], torch.zeros(3)) and acc.vanished == 1  # unit(0) = 0, not the mean
    torch.testing.assert_close(out[3:], torch.tensor([3.0, 2.0]))  # the embedding's weighted mean
    assert buffers.taken == 0
    buffers = Counting()
    stream(d, [1.0, 1.0], segments, "rda", True, buffers)
    assert buffers.taken == 1  # the paper's fallback keeps Σ w·Δ beside Σ w·unit(Δ)


def test_streaming_merge_folds_in_chunks_and_takes_the_callers_norms(monkeypatch):
    monkeypatch.setattr(merge_module, "CHUNK", 64)  # several chunks per tensor
    g = torch.Generator().manual_seed(3)
    segments = [(200, True), (1000, False), (130, False)]
    deltas = [torch.randn(1330, generator=g) * (i + 1) for i in range(4)]
    deltas[1][1200:] = 0.0
    weights = [2.0, 1.0, 0.5, 3.0]
    acc = StreamingMerge(segments, "rda")
    for d, w in zip(deltas, weights):
        acc.add(d.clone(), w, norms=segment_norms(d, segments))
    torch.testing.assert_close(acc.result(), merge(deltas, weights, segments, "rda"), rtol=1e-5, atol=1e-6)
    assert segment_norms(deltas[1], segments)[2] == 0.0


@pytest.mark.parametrize("first_norms_given", [True, False])
def test_a_second_contribution_becomes_the_sum_while_the_first_is_decoded_into_it(monkeypatch, first_norms_given):
    monkeypatch.setattr(codec, "CHUNK_BLOCKS", 3)  # decode chunks of 192 values: they straddle the tensors
    g = torch.Generator().manual_seed(11)
    segments = [(300, True), (1000, False), (70, True), (64, True)]
    deltas = [torch.randn(1434, generator=g) for _ in range(3)]
    deltas[0][1300:1370] = 0.0  # unit(0) = 0 in the first contribution, then in the second
    deltas[1][1370:] = 0.0
    weights = [2.0, 5.0, 1.0]

    buffers, merged = Counting(), []
    acc = StreamingMerge(segments, "rda", buffers, mean_fallback=False)
    for i, (d, w) in enumerate(zip(deltas, weights)):
        payload = codec.encode(d, "int4")
        decoded = codec.decode(payload)
        merged.append(decoded.clone())
        norms = segment_norms(decoded, segments) if first_norms_given or i else None
        acc.add(decoded, w, norms, payload=payload)
        if i == 1:
            assert acc.sum is decoded  # the second's buffer is the round's one sum
    assert buffers.taken == 0  # no buffer for the first contribution's decode
    torch.testing.assert_close(acc.result(), merge(merged, weights, segments, "rda"), rtol=1e-5, atol=1e-6)
