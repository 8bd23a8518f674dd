"""Two learners whose pushes are computed and encoded where their models live (`device_codec=True`) train against a
syncer over gRPC: the sender thread makes the payloads, the syncer merges them, the learners apply the results."""

import torch
from torch import nn

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode
from fakes import token_step


def test_device_codec_learners_train_against_a_syncer():
    cfg = for_mode("decoupled", 2, fragments=3, sync_every=6)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)))
        learners = [Learner(m, GrpcTransport(syncer.address), f"l{i}", device_codec=True) for i, m in enumerate(models)]
        optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
        losses = []
        for _ in range(60):
            for m, o, learner in zip(models, optimizers, learners):
                loss = token_step(m, o, 32)
                learner.step(64)
            losses.append(loss.item())
        for learner in learners:
            learner.finish(timeout=60)
    finally:
        status = syncer.stop()
    assert all(learner.applied >= 3 and learner.refused == 0 for learner in learners)
    assert all(learner._deltas.allocations == 0 for learner in learners)  # no Δ staged on the host
    assert min(status["versions"][: cfg.fragments]) >= 2 and losses[-1] < losses[0] / 2
