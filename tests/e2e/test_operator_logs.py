"""What an operator sees by default: `diloco syncer` and `diloco learner` log at INFO, where they are, who joins and
leaves, and a line of progress a minute."""

import logging
import subprocess
import sys
import time

from diloco.config import for_mode
from diloco.inprocess import LocalSyncer, LocalTransport
from diloco.syncer.core import SyncerCore
from diloco.syncer.serving.server import ProgressLine
from diloco.train import loop
from diloco.train.train_config import ModelConfig, TrainConfig
from diloco.train.loop import WorkerOptions, run_learner


def test_the_syncer_logs_a_line_of_progress_a_minute(caplog):
    line = ProgressLine(every=0.0)
    status = {"initialized": True, "rounds": 42, "tokens_trained": 123456, "tokens_merged": 100000,
              "refusals": {"stale": 2, "norm outlier": 1}, "dropped_rounds": 1, "budget_progress": 0.5,
              "learners": [{"state": "live"}, {"state": "live"}, {"state": "left"}]}
    with caplog.at_level(logging.INFO, logger="diloco.syncer"):
        line.maybe_log(status)
    assert "42 rounds" in caplog.text and "2 learners live of 3 known" in caplog.text
    assert "3 refusals, 1 dropped rounds, 50% of the budget" in caplog.text


def test_a_learner_logs_a_line_of_progress(caplog, monkeypatch):
    monkeypatch.setattr(loop, "PROGRESS_EVERY_SECONDS", 0.0)
    cfg = TrainConfig(model=ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2), batch_size=2)
    local = LocalSyncer(SyncerCore(for_mode("decoupled", 1, fragments=2, sync_every=4)))
    with caplog.at_level(logging.INFO, logger="diloco.learner"):
        run_learner(cfg, LocalTransport(local), WorkerOptions("a", max_steps=3))
    assert "step 3 (" in caplog.text and "pushes" in caplog.text


def test_diloco_syncer_says_where_it_listens_and_its_dashboard_by_default(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "--listen", "127.0.0.1:0", "--http",
                             "127.0.0.1:0", "--state", str(tmp_path / "s")], stderr=subprocess.PIPE, text=True)
    try:
        seen, deadline = "", time.monotonic() + 120
        while "dashboard: http://127.0.0.1:" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()
        assert "syncer listening on 127.0.0.1:0" in seen and "dashboard: http://127.0.0.1:" in seen
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
