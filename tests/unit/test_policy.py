import pytest

from diloco.algorithm.policy import Averages, MovingAverage, PolicyConfig, RoundState, decide, grace_seconds

LIVE = frozenset({"a", "b", "c"})


def state(*who, opened=0.0, quorum_at=None):
    return RoundState(frozenset(who), opened, quorum_at)


def test_waits_for_quorum():
    cfg = PolicyConfig(quorum=2, overlap=2, grace=1.0)
    d = decide(state("a"), LIVE, Averages(), now=5.0, cfg=cfg)
    assert not d.close and "quorum" in d.reason and d.wake_at is None


def test_quorum_opens_grace_window_then_closes_at_its_end():
    cfg = PolicyConfig(quorum=1, overlap=2, grace=1.5)
    d = decide(state("a"), LIVE, Averages(), now=10.0, cfg=cfg)
    assert not d.close and d.quorum_at == 10.0 and d.wake_at == 11.5
    d = decide(state("a", quorum_at=10.0), LIVE, Averages(), now=11.4, cfg=cfg)
    assert not d.close and d.wake_at == 11.5
    d = decide(state("a", "b", quorum_at=10.0), LIVE, Averages(), now=11.5, cfg=cfg)
    assert d.close and d.reason == "grace window ended"


def test_every_live_learner_in_closes_early():
    cfg = PolicyConfig(quorum=1, overlap=2, grace=100.0)
    d = decide(state("a", "b", "c", quorum_at=1.0), LIVE, Averages(), now=1.1, cfg=cfg)
    assert d.close and d.reason == "every live learner contributed"


def test_absent_learners_are_ignored():
    cfg = PolicyConfig(quorum=1, overlap=2, grace=100.0)
    d = decide(state("a", "b", quorum_at=1.0), frozenset({"a", "b"}), Averages(), now=1.0, cfg=cfg)
    assert d.close  # c is absent: nobody left to wait for


def test_quorum_of_all_never_closes_without_every_live_learner():
    cfg = PolicyConfig(quorum=3, overlap=0, grace=0.0)
    assert not decide(state("a", "b"), LIVE, Averages(), now=1e9, cfg=cfg).close
    assert decide(state("a", "b", "c"), LIVE, Averages(), now=0.0, cfg=cfg).close


def test_a_dead_learner_does_not_hold_a_quorum_of_all():
    cfg = PolicyConfig(quorum=3, overlap=0, grace=0.0)  # K = M: synchronous DiLoCo
    d = decide(state("a", "b"), frozenset({"a", "b"}), Averages(), now=0.0, cfg=cfg)  # c absent or gone
    assert d.close and d.reason == "every live learner contributed"


def test_adaptive_grace_uses_only_the_overlap_slack():
    cfg = PolicyConfig(quorum=1, overlap=2, gamma=0.5, cap_steps=1.0)
    assert grace_seconds(Averages(), cfg) == 0.0  # unknown step time: never make anyone wait
    # slack = 2·1.0 − (0.2 + 0.3) = 1.5 → γ·slack = 0.75
    assert grace_seconds(Averages(step=1.0, quorum=0.2, sync=0.3), cfg) == pytest.approx(0.75)
    # slack large → capped at one step
    assert grace_seconds(Averages(step=1.0, quorum=0.0, sync=0.0), PolicyConfig(1, 8, gamma=0.9)) == 1.0
    # sync slower than the overlap → no grace at all
    assert grace_seconds(Averages(step=1.0, quorum=1.0, sync=2.0), cfg) == 0.0


def test_adaptive_grace_drives_decision():
    cfg = PolicyConfig(quorum=1, overlap=2, gamma=0.5)
    avg = Averages(step=1.0, quorum=0.0, sync=0.0)
    d = decide(state("a"), LIVE, avg, now=3.0, cfg=cfg)
    assert not d.close and d.wake_at == pytest.approx(4.0)
    assert decide(state("a", quorum_at=3.0), LIVE, avg, now=4.0, cfg=cfg).close


def test_round_stays_open_for_a_learner_predicted_to_push_soon():
    cfg = PolicyConfig(quorum=1, overlap=2, grace=0.0, expect_steps=4.0)
    avg = Averages(step=1.0)
    d = decide(state("a", opened=10.0), LIVE, avg, now=10.0, cfg=cfg, expected={"b": 12.0})
    assert not d.close and d.wake_at == pytest.approx(12.5)  # its predicted push plus half a step of margin
    assert decide(state("a", opened=10.0, quorum_at=10.0), LIVE, avg, 12.5, cfg, {"b": 12.0}).close  # late: go on
    # predicted beyond the horizon (opening + 4 steps): not waited for
    assert decide(state("a", opened=10.0), LIVE, avg, now=10.0, cfg=cfg, expected={"b": 14.5}).close


def test_predictions_are_ignored_when_off_unknown_or_not_needed():
    avg, expected = Averages(step=1.0), {"b": 12.0, "c": 11.0}
    off = PolicyConfig(quorum=1, overlap=2, grace=0.0)
    assert decide(state("a", opened=10.0), LIVE, avg, 10.0, off, expected).close
    on = PolicyConfig(quorum=1, overlap=2, grace=0.0, expect_steps=4.0)
    assert decide(state("a", opened=10.0), LIVE, Averages(), 10.0, on, expected).close  # no step time yet
    # absent learners and those already in the round do not hold it open
    assert decide(state("a", "c", opened=10.0), frozenset({"a", "c"}), avg, 10.0, on, expected).close
    d = decide(state("a", "b", opened=10.0), LIVE, avg, 10.0, on, expected)
    assert d.wake_at == pytest.approx(11.5)  # only c is awaited
    # an overdue prediction never extends the grace window
    assert decide(state("a", opened=10.0, quorum_at=10.0), LIVE, avg, 10.0, on, {"b": 9.0}).close


def test_moving_average():
    m = MovingAverage(alpha=0.5)
    assert m.value is None
    assert m.update(4.0) == 4.0
    assert m.update(2.0) == 3.0
