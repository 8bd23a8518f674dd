"""The outer momentum under asynchrony: delayed Nesterov (`momentum_every`), and learners' last pushes merged without
the momentum's look-ahead, in the syncer's core, in-process and over gRPC."""

import pytest
import torch
from torch import nn

from diloco.algorithm import codec
from diloco.config import for_mode
from diloco.algorithm.fragments import TensorSpec, plan_fragments
from diloco.inprocess import LocalSyncer, LocalTransport
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.syncer.core import SyncerCore
from diloco.syncer.serving.server import ServerOptions, SyncerThread

SPECS = [TensorSpec("emb", (4, 2), "float32", True), TensorSpec("w1", (3, 2), "float32"), TensorSpec("w2", (5,), "float32")]
ETA, MU = 0.7, 0.9


def paper_core(**overrides):
    cfg = for_mode("decoupled", 2, preset="paper", fragments=3, sync_every=6, codec="fp32", **overrides)
    core = SyncerCore(cfg, clock=lambda: 100.0)
    flats = [torch.zeros(f.numel) for f in plan_fragments(SPECS, 3)]
    core.initialize(SPECS, flats)
    return core


def merge_one(core, session, seq, value, final=False, fragment=1):
    """One learner's push of a constant Δ, merged in a round of its own; returns Θ of the fragment after it."""
    fs = core.fragments[fragment]
    payload = codec.encode(torch.full((fs.fragment.numel,), value), "fp32")
    assert core.push("a", session, seq, fragment, fs.version, 6, 600, payload, final=final).accepted
    core.poll()
    return fs.values.clone()


def test_delayed_nesterov_moves_theta_as_one_nesterov_step_on_the_mean_of_n_rounds():
    core = paper_core(momentum_every=3)
    session = core.join("a", SPECS)
    deltas = [0.3, 0.6, 0.9]
    thetas = [merge_one(core, session, i + 1, d) for i, d in enumerate(deltas[:2])]
    # rounds 1 and 2: plain steps −η·Δ/3, the momentum untouched
    assert torch.allclose(thetas[0], torch.full_like(thetas[0], -ETA * 0.1))
    assert torch.allclose(thetas[1], torch.full_like(thetas[1], -ETA * 0.3))
    assert core.fragments[1].momentum.abs().max().item() == 0.0
    thetas.append(merge_one(core, session, 3, deltas[2]))
    # round 3 completes N = 3: v = mean Δ = 0.6, and Θ is one Nesterov step on the mean from 0
    mean = sum(deltas) / 3
    assert torch.allclose(core.fragments[1].momentum, torch.full_like(thetas[2], mean))
    assert torch.allclose(thetas[2], torch.full_like(thetas[2], -ETA * (mean + MU * mean)), atol=1e-6)
    # and the next three rounds take the second Nesterov step: v = μ·v + mean
    for i, d in enumerate(deltas):
        theta = merge_one(core, session, 4 + i, d)
    v = MU * mean + mean
    assert torch.allclose(theta, torch.full_like(theta, -ETA * (mean + MU * mean) - ETA * (mean + MU * v)), atol=1e-6)


def test_paper_preset_takes_a_nesterov_step_on_every_round():
    core = paper_core()
    session = core.join("a", SPECS)
    first, second = merge_one(core, session, 1, 0.5), merge_one(core, session, 2, 0.5)
    assert torch.allclose(first, torch.full_like(first, -ETA * (0.5 + MU * 0.5)))
    assert torch.allclose(second - first, torch.full_like(first, -ETA * (0.5 + MU * (MU * 0.5 + 0.5))))


@pytest.mark.parametrize("every", [1, 2])
def test_a_round_of_last_pushes_takes_a_plain_step_and_leaves_the_momentum(every):
    core = paper_core(momentum_every=every)
    session = core.join("a", SPECS)
    for seq in range(1, 5):
        theta = merge_one(core, session, seq, 0.5)
    momentum, pending = core.fragments[1].momentum.clone(), core.fragments[1].pending_share
    assert momentum.abs().min().item() > 0
    after = merge_one(core, session, 5, 0.2, final=True)
    # Θ moves by the plain step −η·Δ/N alone: no look-ahead along the momentum, which is as it was
    assert torch.allclose(after - theta, torch.full_like(theta, -ETA * 0.2 / every), atol=1e-6)
    assert torch.equal(core.fragments[1].momentum, momentum) and core.fragments[1].pending_share == pending
    # a round that is not all last pushes is an ordinary one: it counts toward (or takes) the next momentum step
    merge_one(core, session, 6, 0.2)
    fs = core.fragments[1]
    assert fs.pending_share != pending or not torch.equal(fs.momentum, momentum)


def test_momentum_every_below_one_is_refused():
    with pytest.raises(ValueError, match="--momentum-every must be at least 1"):
        for_mode("decoupled", 2, preset="paper", momentum_every=0)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))


def train(learner, model, n):
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    g = torch.Generator().manual_seed(n)
    for _ in range(n):
        x = torch.randint(0, 16, (4, 4), generator=g)
        loss = nn.functional.cross_entropy(model(x), x.sum(1) % 16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        learner.step(16)


def final_flags(events):
    """(learner, final) of every contributor of every round in `events` (the core's on_event calls)."""
    return [(c["learner"], c.get("final", False)) for kind, fields in events if kind == "round"
            for c in fields["contributors"]]


def test_finish_marks_a_learners_last_pushes_in_process():
    core = SyncerCore(for_mode("decoupled", 1, fragments=2, sync_every=4))
    events = []
    core.on_event = lambda kind, fields: events.append((kind, fields))
    model = net()
    learner = Learner(model, LocalTransport(LocalSyncer(core)), "a")
    train(learner, model, 11)  # 11 steps of H = 4: both fragments have steps not yet pushed at the end
    assert ("a", True) not in final_flags(events)
    learner.finish(timeout=30)
    flags = final_flags(events)
    assert ("a", False) in flags and flags[-2:] == [("a", True), ("a", True)]


def test_finish_marks_a_learners_last_pushes_over_grpc():
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.1)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        events = []
        core = syncer.service.core
        core.on_event = lambda kind, fields, chain=core.on_event: (
            events.append((kind, fields)), chain and chain(kind, fields))
        model = net()
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        train(learner, model, 10)
        learner.finish(timeout=60)
        flags = final_flags(events)
        assert ("a", True) in flags and flags[-1] == ("a", True)
    finally:
        syncer.stop()
