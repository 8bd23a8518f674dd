"""benchmarks/gpu/device_rounds.py: decoupled DiLoCo's learners and rounds on one device give the global model that the
Learner and the in-process syncer give, to float tolerance, on CPU."""


import numpy as np
import pytest
import torch

from diloco import Learner, LocalSyncer, LocalTransport, for_mode
from diloco.syncer.core import SyncerCore
from diloco.train.train_config import ModelConfig, TrainConfig, lr_at
from diloco.train.data import ShardSampler

from benchmarks.gpu.device_rounds import HONEST_LEARNERS, DeviceRounds
from benchmarks.gpu.setup import Replica, Setup

# honest learners: the defences are left out of device rounds (their docstring says why)
HONEST = HONEST_LEARNERS


def setup() -> Setup:
    model = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    train = TrainConfig(model=model, batch_size=8, lr=3e-3, warmup_steps=5, seed=0)
    tokens = np.random.default_rng(0).integers(0, 64, 40_000).astype(np.uint16)
    return Setup(torch.device("cpu"), model, train, 8, tokens=0, train_tokens=tokens)


def train(s: Setup, cfg, learners: int, steps: int, device: bool, finish: bool = False) -> dict[str, torch.Tensor]:
    """`steps` turns of `learners` learners in lockstep; the global model after them."""
    reps = [Replica(s, torch.float32) for _ in range(learners)]
    samplers = [ShardSampler(s.train_tokens, i, learners, s.model.seq_len, 4, 0) for i in range(learners)]
    if device:
        rounds = DeviceRounds([r.model for r in reps], cfg)
    else:
        local = LocalSyncer(SyncerCore(cfg))
        members = [Learner(r.model, LocalTransport(local), f"l{i}") for i, r in enumerate(reps)]
    for step in range(steps):
        for i, (rep, sampler) in enumerate(zip(reps, samplers)):
            x, y = sampler.next_batch()
            rep.step(x, y, lr_at(step, s.train, step / steps))
            if device:
                rounds.stepped(i, x.numel())
            else:
                members[i].step(x.numel())
        if device:
            rounds.end_turn()
        else:
            local.tick()
    if not device:
        return local.core.params()
    return rounds.params()


@pytest.mark.parametrize("overrides", [
    # the decoupled defaults: int4 up, int8 down with Θ as P + a bf16 residual, RDA, η = 1, μ = 0, keeping the
    # overlap (measured 7·10⁻⁶ of the distance moved after 40 steps)
    {},
    # lossless codecs where the float rounding of the two merges (the reference merge here, the syncer's streaming
    # one there) could otherwise tip a quantised value into the next step, which training then amplifies
    dict(codec="fp32", down_codec="fp32"),
    dict(preset="paper", codec="fp32"),  # η 0.7, μ 0.9 on every round, published to every live learner, overwrite
    dict(preset="paper", codec="fp32", momentum_every=2),  # delayed Nesterov
])
def test_device_rounds_give_the_in_process_syncers_global_model(overrides):
    s = setup()
    cfg = for_mode("decoupled", 2, fragments=4, sync_every=8, quorum=2, **{**HONEST, **overrides})
    reference = train(s, cfg, 2, 40, device=False)
    got = train(s, cfg, 2, 40, device=True)
    assert reference.keys() == got.keys()
    start = Replica(s, torch.float32).model.state_dict()
    for name, value in reference.items():
        moved = (value - start[name]).abs().max().item()
        assert moved > 0, name  # the rounds did change it
        off = (got[name] - value).abs().max().item()
        assert off <= 1e-3 * moved, (name, off, moved)


def test_a_round_of_the_defaults_gives_the_syncers_values():
    """One round of two contributions through the syncer's core and through device rounds, with the default codecs
    (int4 up, int8 down, Θ kept as P + a bf16 residual): the same global model to float rounding."""
    s = setup()
    cfg = for_mode("decoupled", 2, fragments=4, sync_every=8, quorum=2, **HONEST)
    reference = train(s, cfg, 2, 2, device=False)  # fragment 1 (offset 2) merged once, nothing applied yet
    got = train(s, cfg, 2, 2, device=True)
    start = Replica(s, torch.float32).model.state_dict()
    changed = [n for n in reference if not torch.equal(reference[n], start[n])]
    assert changed
    for name in reference:
        assert torch.allclose(got[name], reference[name], rtol=0, atol=1e-7), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_rounds_never_wait_for_the_gpu():
    """Pushes, rounds, the outer step, the downlink and applies: none of them synchronises with the device."""
    s = setup()
    s.device = torch.device("cuda")
    cfg = for_mode("decoupled", 2, fragments=4, sync_every=8, **HONEST)
    reps = [Replica(s, torch.bfloat16) for _ in range(2)]
    rounds = DeviceRounds([r.model for r in reps], cfg)
    samplers = [ShardSampler(s.train_tokens, i, 2, s.model.seq_len, 4, 0) for i in range(2)]
    for step in range(20):
        for i, (rep, sampler) in enumerate(zip(reps, samplers)):
            x, y = (t.to(s.device) for t in sampler.next_batch())
            rep.step(x, y, 1e-3)
            torch.cuda.set_sync_debug_mode("error")
            try:
                rounds.stepped(i, x.numel())
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.set_sync_debug_mode("error")
        try:
            rounds.end_turn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert rounds.closed > 0
