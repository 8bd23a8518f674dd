"""A learner's whole state_dict takes part: frozen parameters and buffers come from the global model on join,
floating-point buffers are averaged, integer buffers stay local, and the syncer's model loads strictly."""

import threading

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from diloco import GrpcTransport, Learner, LocalSyncer, LocalTransport, ServerOptions, SyncerThread, for_mode
from diloco.syncer.core import SyncerCore
from diloco.syncer.at_rest.model_file import save_model


class Net(nn.Module):
    """BatchNorm (float running statistics and an int counter), a frozen layer and a trained head."""

    def __init__(self, frozen_seed: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16)
        with torch.no_grad():  # learners disagree about the frozen layer until they join
            g = torch.Generator().manual_seed(frozen_seed)
            self.frozen.weight.copy_(torch.randn(8, 8, generator=g))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.frozen(self.embed(x)))))


def train(learner: Learner, model: Net, steps: int, seed: int) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 16, (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x), (x * 3 + seed) % 16)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(x.numel(), loss=loss.item())


def test_join_replaces_frozen_weights_and_buffers_and_the_final_model_evaluates_like_a_learner(tmp_path):
    # synchronous DiLoCo with fp32 both ways: right after each sync every learner holds exactly the global model
    cfg = for_mode("diloco", 2, sync_every=5)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path))
    models = {"a": Net(frozen_seed=1), "b": Net(frozen_seed=2)}
    with torch.no_grad():
        models["b"].norm.running_mean.fill_(5.0)  # b's buffers disagree too
    try:
        learners = {i: Learner(m, GrpcTransport(syncer.address), i) for i, m in models.items()}
        a, b = models["a"], models["b"]
        assert torch.equal(a.frozen.weight, b.frozen.weight)  # b got a's (the global) frozen layer
        assert torch.equal(b.norm.running_mean, torch.zeros(8))
        threads = [threading.Thread(target=train, args=(learners[i], models[i], 20, seed))
                   for seed, i in enumerate(models)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(learner.applied >= 4 for learner in learners.values())
        # the running statistics moved during training and were averaged: both learners hold the same ones
        assert not torch.equal(a.norm.running_mean, torch.zeros(8))
        assert torch.equal(a.norm.running_mean, b.norm.running_mean)
        assert a.norm.num_batches_tracked.item() == 20  # int buffers stay local
        for learner in learners.values():
            learner.finish()
    finally:
        syncer.stop()
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["norm.num_batches_tracked"].dtype == torch.int64
    final = Net(frozen_seed=3)
    final.load_state_dict(saved, strict=True)
    x = torch.arange(16)
    for m in (final, a):
        m.eval()
    torch.testing.assert_close(final(x), a(x), rtol=0, atol=1e-6)
    assert torch.equal(final.frozen.weight, a.frozen.weight)


def test_buffers_stay_local_when_syncing_them_is_off():
    core = SyncerCore(for_mode("decoupled", 2, fragments=2, sync_every=2, overlap=0, sync_buffers=False))
    local = LocalSyncer(core)
    a, b = Net(), Net()
    la, lb = Learner(a, LocalTransport(local), "a"), Learner(b, LocalTransport(local), "b")
    train(la, a, 6, 0)
    train(lb, b, 6, 1)
    local.tick()
    assert not torch.equal(a.norm.running_mean, b.norm.running_mean)
    assert all(s.fragment.role == "params" for s in la.slots)


def test_a_tied_head_stays_tied_and_is_saved_under_both_names(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.wte = nn.Embedding(16, 8)
            self.mid = nn.Linear(8, 8)
            self.lm_head = nn.Linear(8, 16, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, x):
            return self.lm_head(torch.tanh(self.mid(self.wte(x))))

    core = SyncerCore(for_mode("decoupled", 1, fragments=2, sync_every=2, overlap=0))
    model = Tied()
    learner = Learner(model, LocalTransport(LocalSyncer(core)), "a")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(6):
        x = torch.randint(0, 16, (8,))
        loss = nn.functional.cross_entropy(model(x), x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(8)
    assert model.lm_head.weight is model.wte.weight and learner.applied >= 2
    saved = core.params()
    assert torch.equal(saved["lm_head.weight"], saved["wte.weight"])
    fresh = Tied()
    fresh.load_state_dict(saved, strict=True)
    assert fresh.lm_head.weight.data_ptr() == fresh.wte.weight.data_ptr()
    # the syncer's file, written a fragment at a time, holds the same tensors and loads the same way
    save_model(core, tmp_path / "model.safetensors", rounds=core.rounds)
    written = load_file(tmp_path / "model.safetensors")
    assert written.keys() == saved.keys() and all(torch.equal(written[k], v) for k, v in saved.items())
    Tied().load_state_dict(written, strict=True)


def test_a_bf16_model_pushes_against_an_fp32_base_and_trains():
    core = SyncerCore(for_mode("decoupled", 1, fragments=2, sync_every=4, overlap=1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 16), nn.Linear(16, 16)).to(torch.bfloat16)
    learner = Learner(model, LocalTransport(LocalSyncer(core)), "a")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.arange(16)
    losses = []
    for _ in range(24):
        loss = nn.functional.cross_entropy(model(x).float(), x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(16, loss=loss.item())
        losses.append(loss.item())
    assert all(s.base.dtype == torch.float32 for s in learner.slots)
    assert all(fs.outer_values().dtype == torch.float32 for fs in core.fragments)
    assert learner.applied >= 4 and losses[-1] < losses[0] - 0.5
    assert core.params()["1.weight"].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("tokens", [0, -5, 2.5])
def test_bad_token_counts_are_refused(tokens):
    learner = Learner(Net(), LocalTransport(LocalSyncer(SyncerCore(for_mode("decoupled", 1, fragments=2)))), "a")
    with pytest.raises(ValueError, match="tokens"):
        learner.step(tokens)


def test_a_model_that_changed_shape_and_a_step_after_finish_are_refused():
    model = Net()
    learner = Learner(model, LocalTransport(LocalSyncer(SyncerCore(for_mode("decoupled", 1, fragments=2,
                                                                            sync_every=2, overlap=1)))), "a")
    model.head = nn.Linear(8, 17)
    with pytest.raises(ValueError, match="head.weight is \\[17, 8\\], it was \\[16, 8\\]"):
        learner.step(8)
        learner.step(8)
    model.head = nn.Linear(8, 16)
    learner.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        learner.step(8)


def test_a_ddp_model_over_several_ranks_needs_the_process_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # rank 0 of a 2-rank job, with PyTorch's fake process group (collectives do nothing). A gloo group here could
    # hang the test at its end: freeing DDP's reducer joins gloo's worker threads while holding the GIL, and a worker
    # still freeing the constructor's broadcast needs the GIL (seen on a loaded machine).
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ddp = nn.parallel.DistributedDataParallel(Net())
        with pytest.raises(ValueError, match="process_group"):
            Learner(ddp, LocalTransport(LocalSyncer(SyncerCore(for_mode("decoupled", 1, fragments=2)))), "a")
    finally:
        dist.destroy_process_group()


def test_the_model_file_is_written_from_the_published_values_and_residual_with_every_dtype(tmp_path):
    # int8 down: Θ is P + a bf16 residual, made a fragment at a time as the file is written
    core = SyncerCore(for_mode("decoupled", 1, fragments=2, sync_every=2, overlap=0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4).to(torch.bfloat16))
    learner = Learner(model, LocalTransport(LocalSyncer(core)), "a")
    for _ in range(6):
        for p in model.parameters():
            p.data.add_(0.01)
        learner.step(8)
    assert any(fs.residual is not None for fs in core.fragments)
    save_model(core, tmp_path / "model.safetensors")
    written, expected = load_file(tmp_path / "model.safetensors"), core.params()
    assert written.keys() == expected.keys() and all(torch.equal(written[k], v) for k, v in expected.items())
    assert written["1.num_batches_tracked"].dtype == torch.int64 and written["2.weight"].dtype == torch.bfloat16


def test_a_learner_lowers_the_thread_switch_interval_while_it_runs_and_restores_it():
    import sys

    from diloco.learner.gil import GIL_SWITCH_SECONDS

    before = sys.getswitchinterval()
    local = LocalSyncer(SyncerCore(for_mode("decoupled", 2, fragments=1, sync_every=2, overlap=0)))
    a = Learner(nn.Linear(4, 4), LocalTransport(local), "a")
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_SECONDS)  # background threads yield the GIL sooner
    b = Learner(nn.Linear(4, 4), LocalTransport(local), "b")
    a.finish()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_SECONDS)  # b still runs
    b.close()
    assert sys.getswitchinterval() == before
    c = Learner(nn.Linear(4, 4), LocalTransport(local), "c", gil_switch_seconds=None)
    assert sys.getswitchinterval() == before
    c.finish()
    with pytest.raises(ValueError, match="gil_switch_seconds"):
        Learner(nn.Linear(4, 4), LocalTransport(local), "d", gil_switch_seconds=0)
