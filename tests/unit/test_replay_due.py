"""A round closes as of when the policy had it due, however late the syncer wakes up: a push arriving after that is
let in only once the round is closed, and the tape's due time is what `diloco replay` checks exactly."""

import json

import torch

from diloco.algorithm import codec
from diloco.cli import main
from diloco.syncer.replay import replay, wake_up_latency
from diloco.syncer.observation.tape import Tape, read

from cores import SPECS, core_in_memory  # the core tests' model


def make_core(tmp_path, learners: str, **overrides):
    core, clock = core_in_memory(len(learners), SPECS, sync_every=6, codec="fp32", **overrides)  # clock at 100
    core.tape = Tape(tmp_path / "tape.jsonl")  # its times are 100 less than the clock's
    core.tape.record("start", config=json.loads(core.cfg.to_json()))
    return core, clock, {lid: core.join(lid, SPECS) for lid in learners}


def push(core, sessions, lid, seq, base_version=0):
    payload = codec.encode(torch.full((core.fragments[1].fragment.numel,), 0.1), "fp32")
    assert core.push(lid, sessions[lid], seq, 1, base_version, 6, 60, payload).accepted


def rounds(tmp_path, core):
    core.tape.close()
    events = read(tmp_path / "tape.jsonl")
    return events, [e for e in events if e["event"] == "round"]


def test_a_push_after_the_grace_window_ended_waits_for_a_late_tick_to_close_the_round_first(tmp_path):
    core, clock, sessions = make_core(tmp_path, "abc", quorum=1, grace=1.0)
    push(core, sessions, "a", 1)
    assert core.poll() == [] and core.next_wakeup() == 101.0  # quorum at a's arrival: the window ends at 101
    clock.now = 101.5  # the syncer's wake-up at 101 comes late (a busy machine): b's push is first
    push(core, sessions, "b", 1)
    fs = core.fragments[1]
    assert fs.version == 1 and list(fs.pending) == ["b"]  # a's round closed without b; b opened the next
    assert fs.pending["b"].base_version == 0 and fs.opened_at == 101.5 and fs.quorum_at == 101.5
    assert [(p.learner, p.version) for p in core.poll()] == [("a", 1)]  # the closed round's answer, at the tick
    assert core.next_wakeup() == 102.5  # b's round has a window of its own
    clock.now = 102.0
    push(core, sessions, "c", 1, base_version=1)  # within it: c joins b's round
    clock.now = 103.0
    assert sorted(p.learner for p in core.poll()) == ["b", "c"]
    events, (first, second) = rounds(tmp_path, core)
    assert [c["learner"] for c in first["contributors"]] == ["a"]
    decision = first["decision"]
    assert decision["reason"] == "grace window ended" and decision["due"] == 1.0 and decision["now"] == 1.5
    assert [c["learner"] for c in second["contributors"]] == ["b", "c"]
    assert second["contributors"][0]["staleness"] == 1  # based on the version before a's round
    assert "check" not in second["contributors"][0] and second["contributors"][1]["check"]["present"] == 1
    assert second["decision"]["due"] == 2.5 and second["decision"]["now"] == 3.0
    assert replay(events) == (2, []) and wake_up_latency(events) == [0.5, 0.5]


def test_a_round_every_learner_is_in_is_due_at_its_last_push_and_a_later_push_starts_the_next(tmp_path, capsys):
    core, clock, sessions = make_core(tmp_path, "ab", quorum=1, grace=100.0)
    push(core, sessions, "a", 1)
    assert core.poll() == []
    clock.now = 100.2
    push(core, sessions, "b", 1)  # every live learner is in: due now, but the tick comes late
    clock.now = 100.5
    push(core, sessions, "a", 2)  # a's next push: not a second push into that round, the first of the next
    fs = core.fragments[1]
    assert fs.version == 1 and list(fs.pending) == ["a"] and fs.pending["a"].seq == 2
    assert sorted(p.learner for p in core.poll()) == ["a", "b"]
    core.poll(force=True)
    events, (first, forced) = rounds(tmp_path, core)
    assert first["decision"]["reason"] == "every live learner contributed"
    assert first["decision"]["due"] == 0.2 and first["decision"]["now"] == 0.5
    assert forced["decision"]["reason"] == "forced" and [c["learner"] for c in forced["contributors"]] == ["a"]
    assert main(["replay", str(tmp_path / "tape.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "2 rounds replayed, 0 differences" in out and "median 0.300 s, max 0.300 s over 1 closes" in out


def test_replay_reports_a_due_time_the_policy_does_not_give(tmp_path, capsys):
    core, clock, sessions = make_core(tmp_path, "abc", quorum=1, grace=1.0)
    push(core, sessions, "a", 1)
    core.poll()
    clock.now = 100.4
    push(core, sessions, "b", 1)
    clock.now = 101.3
    assert core.poll()
    events, (round_,) = rounds(tmp_path, core)
    assert round_["decision"]["due"] == 1.0 and replay(events) == (1, [])
    round_["decision"]["due"] = 1.2  # as if the syncer had let the round run on past its window
    replayed, differences = replay(events)
    assert replayed == 1 and [d.what for d in differences] == [
        "would have closed 0.200 s earlier, at 1.000 s with 2 of 2 contributors (grace window ended); the syncer's "
        "close was due at 1.200 s"]
    assert replay(events, slack=0.25) == (1, [])  # within the slack given
    round_["decision"]["due"] = 0.9  # before the window ended: the policy would still wait
    assert "would still wait (grace window open)" in replay(events)[1][0].what


def test_a_round_left_with_no_one_to_wait_for_is_due_when_the_last_learner_it_awaited_left(tmp_path):
    core, clock, sessions = make_core(tmp_path, "abc", quorum=1, grace=100.0)
    push(core, sessions, "a", 1)
    clock.now = 100.2
    push(core, sessions, "b", 1)
    assert core.poll() == []  # c is awaited
    clock.now = 100.7
    core.leave("c", sessions["c"])  # then no one is left to wait for; the tick comes late
    clock.now = 101.0
    assert sorted(p.learner for p in core.poll()) == ["a", "b"]
    events, (round_,) = rounds(tmp_path, core)
    decision = round_["decision"]
    assert decision["reason"] == "every live learner contributed" and decision["live"] == ["a", "b"]
    assert decision["due"] == 0.7 and decision["now"] == 1.0
    assert round_["contributors"][1]["check"]["live"] == ["a", "b", "c"]  # when b was let in, c was awaited
    assert replay(events) == (1, []) and wake_up_latency(events) == [0.3]
