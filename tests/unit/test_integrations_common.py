"""The framework-free pieces of diloco.integrations: the token rule, the budget learning rate, the rejoin record,
the key lines on stderr."""

import json
import subprocess
import sys

import pytest
import torch

from diloco.integrations import rejoin
from diloco.integrations.budget_lr import decay_tail, follow_budget
from diloco.integrations.tokens import count_tokens


def test_the_token_rule_prefers_the_attention_mask_then_labels_then_ids():
    ids = torch.ones(2, 5, dtype=torch.int64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[1, 1, -100, -100, -100], [1, 1, 1, 1, 1]])
    assert count_tokens({"input_ids": ids, "attention_mask": mask, "labels": labels}) == 8
    assert count_tokens({"input_ids": ids, "labels": labels}) == 7
    assert count_tokens({"input_ids": ids}) == 10
    assert count_tokens({"inputs_embeds": torch.zeros(2, 5, 16)}) == 10
    assert count_tokens(ids) == 10 and count_tokens((ids, labels)) == 10 and count_tokens([ids]) == 10
    assert count_tokens({"pixels": torch.zeros(3)}) == 0 and count_tokens(()) == 0 and count_tokens("text") == 0


def test_decay_tail_holds_then_decays_linearly_to_its_final_factor():
    f = decay_tail(final=0.1, tail=0.2)
    assert f(0.0) == f(0.8) == 1.0
    assert f(0.9) == pytest.approx(0.55) and f(1.0) == pytest.approx(0.1) and f(2.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="0 < tail <= 1"):
        decay_tail(tail=0)


def test_the_budget_multiplies_a_lambda_schedule_once_and_sets_the_rate_without_one():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    progress = [0.9]
    for _ in range(2):  # a scheduler reused by a second train(): still the budget's factor once
        follow_budget(opt, sched, decay_tail(), lambda: progress[0])
        assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.55)
    assert sched.state_dict()["lr_lambdas"] == [None]  # a checkpoint does not try to pickle the closure
    progress[0] = 1.0
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.1)

    opt = torch.optim.SGD([p], lr=2.0)
    progress[0] = None  # nothing heard from the syncer yet: the start of the budget
    update = follow_budget(opt, None, decay_tail(), lambda: progress[0])
    assert opt.param_groups[0]["lr"] == 2.0
    progress[0] = 0.9
    update()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="StepLR: choose one of those, or drop lr_schedule"):
        follow_budget(opt, torch.optim.lr_scheduler.StepLR(opt, 1), decay_tail(), lambda: 0.0)


def test_a_rejoin_record_round_trips_and_says_what_differs_from_the_ledger(tmp_path):
    record = rejoin.RejoinRecord("alice", data_position=40, tokens=1024, versions={0: 3, 1: 5})
    rejoin.write(tmp_path, record)
    assert rejoin.read(tmp_path) == record
    assert rejoin.read(tmp_path / "elsewhere") is None
    rejoin.check_id(record, "alice", "ckpt")
    with pytest.raises(ValueError, match="written by learner 'alice', but this callback joins as 'bob'"):
        rejoin.check_id(record, "bob", "ckpt")

    assert rejoin.compare(record, 40, {0: 4, 1: 5}, "ckpt") == []
    ahead, = rejoin.compare(record, 48, {0: 4, 1: 5}, "ckpt")
    assert "8 steps past ckpt: their data is trained again" in ahead
    behind, = rejoin.compare(record, 32, {0: 4, 1: 5}, "ckpt")
    assert "the last 8 steps before ckpt never reached the global model" in behind
    older, = rejoin.compare(record, 40, {0: 2, 1: 5}, "ckpt")
    assert "fragment 0 is at version 2, below the 3 that ckpt held" in older

    (tmp_path / rejoin.RECORD_FILE).write_text(json.dumps({"format": 1, "learner_id": "alice"}))
    with pytest.raises(ValueError, match="is not a diloco rejoin record .*delete it to join as a new learner"):
        rejoin.read(tmp_path)
    (tmp_path / rejoin.RECORD_FILE).write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        rejoin.read(tmp_path)


def test_key_lines_reach_stderr_once_whether_or_not_logging_is_configured():
    script = ("import logging; from diloco.integrations import lines\n"
              "lines.logger().info('first line')\n"
              "logging.basicConfig(format='configured: %(message)s', level='INFO')\n"
              "lines.logger().info('second line')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["diloco: first line", "configured: second line"]
