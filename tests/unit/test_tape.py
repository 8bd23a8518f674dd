"""The event tape: rounds, joins, leaves and refusals as JSON lines, rotated, and what `diloco inspect` makes of them."""

import json

import torch

from diloco.algorithm import codec
from diloco.cli import main
from diloco.config import for_mode
from diloco.algorithm.fragments import TensorSpec, plan_fragments
from diloco.syncer.core import SyncerCore
from diloco.syncer.observation.tape import Tape, read, summarise
from fakes import Clock

SPECS = [TensorSpec("emb", (4, 2), "float32", True), TensorSpec("w1", (3, 2), "float32"), TensorSpec("w2", (5,), "float32")]


def test_a_core_records_its_events_and_inspect_summarises_them(tmp_path, capsys):
    # a clock that stands still: with no grace window a round is due when its first push arrives, and a push that
    # arrives later is let in only once it is closed; at one instant both of a round's pushes are in
    core = SyncerCore(for_mode("decoupled", 2, fragments=3, sync_every=6, codec="fp32", grace=0.0,
                               refuse_replays=False), clock=Clock())  # constant pushes repeat
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    core.tape = Tape(tmp_path / "tape.jsonl")
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    n = core.fragments[1].fragment.numel
    for seq in (1, 2):
        for lid, s in (("a", sa), ("b", sb)):
            assert core.push(lid, s, seq, 1, core.fragments[1].version, 6, 60, codec.encode(torch.full((n,), 0.1), "fp32")).accepted
        core.poll()
    stale = core.push("a", sa, 3, 1, 0, 6, 60, codec.encode(torch.full((n,), 0.1), "fp32"))  # based on version 0
    assert stale.accepted  # staleness 2 is within max_staleness
    core.poll()
    assert not core.push("b", sb, 3, 1, 0, 6, 60, codec.encode(torch.full((n,), float("nan")), "fp32")).accepted
    core.leave("b", sb)
    core.tape.close()
    events = read(tmp_path / "tape.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds.count("join") == 2 and kinds.count("round") == 3 and kinds.count("refusal") == 1 and "leave" in kinds
    assert all("mono" in e and "wall" in e for e in events)
    summary = summarise(events)
    assert summary["contributors_per_round"] == {1: 1, 2: 2}
    assert summary["fragments"][1]["measured_h"] == 6.0 and summary["staleness"].get(2) == 1
    assert summary["refusals"] == {"non-finite values": 1}
    assert main(["inspect", str(tmp_path / "tape.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == 3
    assert main(["inspect", str(tmp_path / "tape.jsonl")]) == 0
    assert "measured H" in capsys.readouterr().out


def test_the_tape_is_rotated_and_read_back_in_order(tmp_path):
    tape = Tape(tmp_path / "tape.jsonl", max_bytes=400, backups=3)
    for i in range(30):
        tape.record("round", i=i)
    tape.close()
    assert (tmp_path / "tape.jsonl.1").exists() and not (tmp_path / "tape.jsonl.4").exists()  # bounded
    seen = [e["i"] for e in read(tmp_path / "tape.jsonl")]
    assert seen == sorted(seen) and seen[-1] == 29 and len(seen) < 30  # oldest rotated away


def test_round_events_feed_participation_staleness_and_round_time_metrics():
    from diloco.syncer.observation.metrics import SyncerMetrics

    metrics = SyncerMetrics()
    metrics.observe_event("round", {"contributors": [{"staleness": 0}, {"staleness": 3}], "open_seconds": 0.4,
                                    "quorum_seconds": 0.0})
    metrics.observe_event("join", {"learner": "a"})
    text = metrics.exposition().decode()
    assert "diloco_round_contributors_count 1.0" in text and "diloco_round_contributors_sum 2.0" in text
    assert "diloco_contribution_staleness_sum 3.0" in text and "diloco_round_open_seconds_sum 0.4" in text
    assert "diloco_round_quorum_seconds_count 1.0" in text


def test_replay_reproduces_every_round_decision_and_weight_and_finds_a_changed_policy(tmp_path, capsys):
    clock = Clock()
    cfg = for_mode("decoupled", 3, fragments=3, sync_every=6, codec="fp32", grace=1.0, refuse_replays=False)
    core = SyncerCore(cfg, clock=clock)
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    tape = core.tape = Tape(tmp_path / "tape.jsonl")
    tape.record("start", config=json.loads(cfg.to_json()))
    sessions = {lid: core.join(lid, SPECS) for lid in "abc"}
    n = core.fragments[1].fragment.numel
    payload = codec.encode(torch.full((n,), 0.1), "fp32")
    for seq in (1, 2, 3):
        core.push("a", sessions["a"], seq, 1, core.fragments[1].version, 6, 60, payload)
        assert core.poll() == []  # quorum (K = 1): the grace window opens, as a real syncer polls after a push
        clock.now += 0.4
        assert core.poll() == []  # the grace window is open
        core.push("b", sessions["b"], seq, 1, core.fragments[1].version - (seq == 3), 18, 180, payload)  # 3H steps
        clock.now += 0.6
        assert core.poll()  # the window (1 s from quorum at the first poll) ended without c
    core.push("c", sessions["c"], 1, 1, core.fragments[1].version, 6, 60, payload)
    core.poll(force=True)
    tape.close()
    assert main(["replay", str(tmp_path / "tape.jsonl")]) == 0
    assert "4 rounds replayed, 0 differences" in capsys.readouterr().out
    lines = (tmp_path / "tape.jsonl").read_text().splitlines()

    def replay_with(**changes) -> str:
        """The replay's output for the same tape under a configuration with `changes` (it must differ)."""
        start = json.loads(lines[0])
        start["config"].update(changes)
        (tmp_path / "changed.jsonl").write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
        assert main(["replay", str(tmp_path / "changed.jsonl")]) == 1
        return capsys.readouterr().out

    # another policy: a quorum of 3 would have kept waiting
    out = replay_with(quorum=3)
    assert "would still wait (waiting for quorum (2/3))" in out and "3 differences" in out
    # another weighting: the 3H-step contribution counted in full (the paper's tokens²/steps)
    out = replay_with(clamp_long_contributions=False)
    assert "b's weight 1800; the syncer used 600" in out and "3 differences" in out
    # a shorter grace window: each round would have closed before b arrived
    out = replay_with(grace=0.2)
    assert "would have closed 0.800 s earlier" in out and "with 1 of 2 contributors (grace window ended)" in out
    assert "3 differences" in out
