"""`split_tensors`: a tensor larger than a fragment's share of the model is cut into pieces in several fragments.
Learners and the syncer derive the same pieces; a joiner gets and keeps the right values, a learner holding the
initial model is sent none of it, pieces are applied in place (a tied head stays tied), and the syncer's model file
holds whole tensors that load strictly."""

import logging

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from diloco import GrpcTransport, Learner, LocalSyncer, LocalTransport, ServerOptions, SyncerThread, for_mode
from diloco.algorithm.fragments import gather
from diloco.syncer.at_rest.model_file import save_model
from diloco.syncer.core import SyncerCore

from liveness import wait_for
from syncers import params, same, wide

pytestmark = pytest.mark.timeout(120)


class Tied(nn.Module):
    """A GPT's shape in miniature: the tied embedding and head hold most of the model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(64, 8)
        self.mid = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 64, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        return self.lm_head(torch.tanh(self.mid(self.wte(x))))


def test_pieces_of_a_tied_embedding_are_applied_in_place_and_the_model_loads_strictly(tmp_path):
    core = SyncerCore(for_mode("decoupled", 1, fragments=4, sync_every=4, overlap=1, split_tensors=True))
    model = Tied()
    learner = Learner(model, LocalTransport(LocalSyncer(core)), "a")
    assert [len([s for s in f.specs if not s.whole]) for f in learner.layout] == [1, 1, 1, 0]  # wte in 3 pieces
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        x = torch.randint(0, 64, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), (x + 1) % 64)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(16)
    assert model.lm_head.weight is model.wte.weight and learner.applied >= 8
    assert all(fs.version >= 2 for fs in core.fragments)
    state = dict(model.state_dict())
    saved = core.params()
    fresh = Tied()
    fresh.load_state_dict(saved, strict=True)
    assert fresh.lm_head.weight.data_ptr() == fresh.wte.weight.data_ptr()
    for fs in core.fragments:  # one learner, fp32 down: it holds Θ's pieces exactly where they belong
        assert torch.equal(gather(dict(fresh.state_dict()), fs.fragment), fs.outer_values())
    assert not torch.equal(saved["wte.weight"], Tied().wte.weight) and set(saved) == set(state)
    save_model(core, tmp_path / "model.safetensors")
    written = load_file(tmp_path / "model.safetensors")
    assert written.keys() == saved.keys() and all(torch.equal(written[k], v) for k, v in saved.items())


def test_a_split_run_over_grpc_sends_a_twin_nothing_gives_a_joiner_the_merged_pieces_and_saves_whole_tensors(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="diloco")
    cfg = for_mode("decoupled", 2, fragments=4, sync_every=4, split_tensors=True, heartbeat_seconds=0.05)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path))
    try:
        model = wide(seed=1)  # an embedding and one 1024 × 1024 weight, cut in three
        first = Learner(model, GrpcTransport(syncer.address), "a")
        assert sum(not s.whole for f in first.layout for s in f.specs) == 3
        twin = Learner(wide(seed=1), GrpcTransport(syncer.address), "b")
        assert "learner b holds 4 of 4 fragments already: not sent" in caplog.text
        twin.close()
        for _ in range(8):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            first.step(16, loss=1.0)
        core = syncer.service.core
        wait_for(lambda: all(fs.version >= 1 for fs in core.fragments), timeout=30)
        late_model = wide(seed=1)
        late = Learner(late_model, GrpcTransport(syncer.address), "c")
        assert not same(params(late_model), params(wide(seed=1)))
        state = dict(late_model.state_dict())
        for fs in core.fragments:  # what learners hold (P), bit for bit, piece by piece
            assert torch.equal(gather(state, fs.fragment), fs.values), fs.fragment.index
        late.close()
        first.finish()
    finally:
        syncer.stop()
    saved = load_file(tmp_path / "model.safetensors")
    final = wide(seed=2)
    final.load_state_dict(saved, strict=True)
    assert not same(params(final), params(wide(seed=1)))
