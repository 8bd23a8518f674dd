"""A learner restarted under its id resumes its inner AdamW state from its own checkpoint."""

import logging

import torch

from diloco.config import for_mode
from diloco.inprocess import LocalSyncer, LocalTransport
from diloco.syncer.core import SyncerCore
from diloco.train.train_config import TrainConfig
from diloco.train.loop import WorkerOptions, run_learner
from diloco.train.optimizer_state import OptimizerCheckpoint
from diloco.train.train_config import ModelConfig


def test_a_restarted_built_in_learner_resumes_its_adam_moments(tmp_path, caplog):
    cfg = TrainConfig(model=ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2), batch_size=2)
    local = LocalSyncer(SyncerCore(for_mode("decoupled", 1, fragments=2, sync_every=4)))
    path = tmp_path / "a.optimizer.pt"
    opts = WorkerOptions("a", max_steps=6, optimizer_checkpoint=path)
    run_learner(cfg, LocalTransport(local), opts)
    saved = torch.load(path, weights_only=True)
    assert saved["learner_id"] == "a" and all(s["step"] == 6 for s in saved["optimizer"]["state"].values())
    with caplog.at_level(logging.INFO, logger="diloco.learner"):
        run_learner(cfg, LocalTransport(local), opts)  # the same id, a fresh process's objects
    assert "resumed the inner optimizer's state" in caplog.text
    again = torch.load(path, weights_only=True)
    assert all(s["step"] == 12 for s in again["optimizer"]["state"].values())  # 6 resumed + 6 more


def test_a_damaged_or_foreign_checkpoint_is_reported_and_left_alone(tmp_path, caplog):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / "x.pt"
    path.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="diloco.learner"):
        assert not OptimizerCheckpoint(path, "a", optimizer).resume()
    assert "its moments start afresh" in caplog.text
    OptimizerCheckpoint(path, "b", optimizer).maybe_save(force=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diloco.learner"):
        assert not OptimizerCheckpoint(path, "a", optimizer).resume()  # another learner's state
    assert "belongs to learner 'b'" in caplog.text
    other = torch.optim.AdamW(torch.nn.Linear(5, 2).parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    OptimizerCheckpoint(path, "a", optimizer).maybe_save(force=True)
    assert not OptimizerCheckpoint(path, "a", other).resume()  # a different model's shapes
