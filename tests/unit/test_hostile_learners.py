"""What a participant holding a valid credential can no longer do to the model, the rounds or the budget: each test
replays one attack against SyncerCore under a fake clock (docs/security.md, Threat model)."""

import math

import pytest
import torch

from diloco.algorithm import codec
from diloco.algorithm.merge import StreamingMerge, merge
from diloco.syncer import rounds
from cores import SPECS, core_in_memory, linspace

H = 6


def make_core(**overrides):
    return core_in_memory(4, SPECS, linspace, sync_every=H, codec="fp32", grace=0.0, grace_expect_steps=0.0,
                          **overrides)


def push(core, lid, session, seq, fragment=1, value=0.01, steps=H, tokens=600, delta=None):
    n = core.fragments[fragment].fragment.numel
    delta = torch.full((n,), value) if delta is None else delta
    return core.push(lid, session, seq, fragment, core.fragments[fragment].version, steps, tokens,
                     codec.encode(delta, "fp32"))


def honest_rounds(core, sessions, rounds_, fragment=1, start_seq=1, value=0.01):
    for r in range(rounds_):
        for lid, s in sessions.items():
            assert push(core, lid, s, start_seq + r, fragment, value=value * (1 + 0.1 * (hash(lid) % 3))).accepted
        core.poll()


def test_a_first_contribution_of_negligible_weight_keeps_the_sums_finite():
    # weights 10^-31 and 10^7: relative to the first the second is 10^38, which overflowed fp32 sums
    segs = [(10, False), (6, True)]
    deltas = [torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    weights = [3e-31, 1e7, 2e7]
    for fallback in (True, False):
        m = StreamingMerge(segs, "rda", None, fallback)
        for d, w in zip(deltas, weights):
            m.add(d.clone(), w)
        out = m.result()
        assert torch.isfinite(out).all()
        assert torch.allclose(out, merge(deltas, weights, segs), atol=1e-5)


def test_one_push_of_absurd_counters_cannot_turn_the_model_non_finite():
    # finding: tokens=1, steps=2^53 opening a round made the next contribution weigh 10^38 times more; the round's
    # sums became inf, the model was published NaN and the third contributor's push died with UNKNOWN
    core, clock = make_core()
    s = {x: core.join(x, SPECS) for x in ("mallory", "a", "b")}
    assert push(core, "mallory", s["mallory"], 1, steps=2**53, tokens=1).accepted
    assert push(core, "a", s["a"], 1, tokens=600).accepted
    assert push(core, "b", s["b"], 1, tokens=600).accepted  # the third contributor is not harmed either
    clock.now += 1.0
    core.poll()
    assert core.fragments[1].version == 1 and codec.all_finite(core.fragments[1].outer_values())
    assert push(core, "a", s["a"], 2, tokens=600).accepted  # and honest pushes go on being merged


def test_a_non_finite_merge_is_dropped_and_the_last_good_values_stay_published(monkeypatch):
    core, clock = make_core()
    sa = core.join("a", SPECS)
    good = core.fragments[1].values.clone()
    monkeypatch.setattr(StreamingMerge, "result", lambda self: torch.full((6,), math.inf))
    assert push(core, "a", sa, 1).accepted
    (pub,) = core.poll()
    assert core.dropped_rounds == 1 and core.fragments[1].version == 0
    assert torch.equal(core.fragments[1].values, good)
    assert pub.full and torch.equal(codec.decode(pub.payload), good)  # the contributor starts over from them
    monkeypatch.undo()
    assert push(core, "a", sa, 2).accepted and core.poll() and core.fragments[1].version == 1


def test_an_outsized_merged_step_is_dropped_not_published():
    core, clock = make_core(norm_ceiling=0.0, max_norm_ratio=0.0)  # only the round bound stands
    s = {x: core.join(x, SPECS) for x in "ab"}
    honest_rounds(core, s, 5)
    before = core.fragments[1].values.clone()
    assert push(core, "a", s["a"], 10, value=5.0).accepted  # 500× the recent rounds
    core.poll()
    assert core.dropped_rounds == 1 and torch.equal(core.fragments[1].values, before)


def test_the_ceiling_counts_declared_steps_only_up_to_h():
    # finding: with steps capped at 2H, one push could carry 2H times the fragment's own norm before any history
    core, _ = make_core()
    s = core.join("mallory", SPECS)
    norm = core.fragments[1].values.norm().item()
    n = core.fragments[1].fragment.numel
    big = torch.full((n,), 1.0) * (1.5 * H * norm / math.sqrt(n))  # 1.5 H × the fragment's norm
    result = push(core, "mallory", s, 1, steps=2 * H, delta=big)
    assert not result.accepted and "norm over ceiling" in result.reason


def test_the_robust_merge_clips_a_contribution_to_other_credentials_typical_size():
    # the clip alone: with the direction or agreement test (on by default) this flip would be merged with no weight
    core, clock = make_core(clip_norm_ratio=4.0, max_norm_ratio=0.0, max_round_ratio=0.0, scale_partial_rounds=False,
                            direction_floor=0.0, agreement_floor=0.0)
    s = {x: core.join(x, SPECS) for x in ("a", "b", "c", "mallory")}
    honest_rounds(core, {x: s[x] for x in "abc"}, 3)
    typical = core.fragments[1].guard.accepted.reference("mallory")
    before = core.fragments[1].outer_values().clone()
    assert push(core, "mallory", s["mallory"], 1, value=-0.5).accepted  # 40-50× the others, sign flipped
    clock.now += 1.0
    core.poll()
    moved = (core.fragments[1].outer_values() - before).norm().item() / H
    assert moved == pytest.approx(4.0 * typical, rel=1e-4)  # merged alone: exactly at the clip


@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_before_others_have_history_the_clip_bound_comes_from_the_fragments_own_norm(ratio):
    from diloco.syncer.defences.norm_guard import PRIOR_PER_STEP, NormGuard, fragment_scale

    guard = NormGuard(numel=1000, ceiling=1.0, ratio=50.0, sync_every=H, clip=ratio)
    prior = PRIOR_PER_STEP * fragment_scale(1000, 3.0)
    assert guard.clip_bound("a", 3.0) == pytest.approx(ratio * prior)
    guard.accept("b", 0.01)  # one other credential: the prior still joins the median
    assert guard.clip_bound("a", 3.0) == pytest.approx(ratio * (0.01 + prior) / 2)
    guard.accept("c", 0.03)  # two: theirs alone
    assert guard.clip_bound("a", 3.0) == pytest.approx(ratio * 0.02)


def test_many_ids_of_one_credential_cannot_reset_the_outlier_reference():
    # finding: the first of two ids was refused as an outlier; the second, as large, made "most learners" and
    # replaced the reference, and both were accepted from then on
    core, clock = make_core()
    s = {x: core.join(x, SPECS) for x in "ab"}
    honest_rounds(core, s, 4)
    sm = {x: core.join(x, SPECS, credential="mallory") for x in ("m1", "m2", "m3")}
    for x in sm:
        result = push(core, x, sm[x], 1, value=2.0)
        assert not result.accepted and "norm outlier" in result.reason
    assert push(core, "a", s["a"], 10).accepted  # the honest reference stands


def test_distinct_credentials_moving_together_still_move_the_reference():
    core, clock = make_core()
    s = {x: core.join(x, SPECS) for x in "ab"}
    honest_rounds(core, s, 4)
    assert not push(core, "a", s["a"], 10, value=2.0).accepted  # one is an outlier
    assert push(core, "b", s["b"], 10, value=2.0).accepted  # most credentials: the population moved


def test_declared_counters_are_bounded_by_other_credentials_typical_ones():
    # finding: one push declaring 24·2^32 tokens, then heartbeats, made every honest round ~10^-7 of a step
    core, clock = make_core(outer_momentum=0.0, outer_lr=1.0)
    s = {x: core.join(x, SPECS) for x in ("a", "b", "mallory")}
    for x in s:
        core.heartbeat(x, s[x], step_seconds=0.1)
    honest_rounds(core, {x: s[x] for x in "ab"}, 3)
    assert push(core, "mallory", s["mallory"], 1, tokens=H * 2**32).accepted
    clock.now += 1.0
    core.poll()
    assert core.learners["mallory"].contribution_tokens.value <= 4 * 600 + 1e-6
    for t in range(3):  # mallory only heartbeats from here, while a pushes alone
        clock.now += 0.5
        core.heartbeat("mallory", s["mallory"], tokens_trained=10**12)
        before = core.fragments[1].outer_values().clone()
        assert push(core, "a", s["a"], 10 + t, value=0.01).accepted
        core.poll()
        step = (before - core.fragments[1].outer_values()).mean().item()
        assert step > 0.01 / (1 + 1 + 4) - 1e-6  # a's share: b and mallory missing, mallory at most 4× a


def test_heartbeat_claims_alone_never_spend_the_budget():
    # finding: one heartbeat claiming 6.4·10^10 tokens right after a join stopped a run with a 10^9-token budget
    core, clock = make_core()
    core.token_budget = 10**9
    s = {x: core.join(x, SPECS) for x in ("a", "mallory")}
    honest_rounds(core, {"a": s["a"]}, 2)
    assert not core.heartbeat("mallory", s["mallory"], tokens_trained=64 * 10**9)
    assert core.budget_progress() < 1e-3


def test_idle_ids_that_only_heartbeat_slow_no_round():
    # finding: 200 ids that only heartbeat cut everyone's progress to 22% (each a missing contribution)
    core, clock = make_core(outer_momentum=0.0, outer_lr=1.0)
    sa = core.join("a", SPECS)
    idle = {f"idle-{i}": core.join(f"idle-{i}", SPECS) for i in range(200)}
    clock.now += core.cfg.absent_after_seconds + 1
    for lid, s in idle.items():
        core.heartbeat(lid, s)
    before = core.fragments[1].outer_values().clone()
    assert push(core, "a", sa, 1, value=0.01).accepted
    core.poll()
    assert torch.allclose(before - core.fragments[1].outer_values(), torch.full((6,), 0.01))  # a full step


def test_counted_counters_are_on_the_tape_and_replay_agrees():
    core, clock = make_core()
    events = []
    core.on_event = lambda kind, fields: events.append((kind, fields))
    s = {x: core.join(x, SPECS) for x in ("a", "b", "mallory")}
    honest_rounds(core, {x: s[x] for x in "ab"}, 2)
    push(core, "mallory", s["mallory"], 1, tokens=H * 2**20)
    clock.now += 1.0
    core.poll()
    (last,) = [f for k, f in events if k == "round"][-1:]
    (m,) = [c for c in last["contributors"] if c["learner"] == "mallory"]
    assert m["tokens"] == H * 2**20 and m["counted"][0] <= 4 * 600
    assert m["weight"] == pytest.approx(m["counted"][0] ** 2 / m["counted"][1])
    assert rounds.counted_as(m["tokens"], m["steps"], core.cfg)[0] > m["counted"][0]


def test_a_push_that_waited_counts_what_there_was_time_to_train_and_no_more():
    # H steps of 600 tokens a second: a and b push fragment 1 every second; "late" pushes it after 5 s, carrying 5 H
    # steps (its pushes waited for a result), "mallory" after 1 s claiming 50 H steps' tokens
    core, clock = make_core(outer_momentum=0.0, outer_lr=1.0)
    s = {x: core.join(x, SPECS) for x in ("a", "b", "late", "mallory")}
    for seq in (1, 2, 3):
        for lid in ("a", "b", "late", "mallory"):
            if lid in ("a", "b") or seq == 1:
                assert push(core, lid, s[lid], seq).accepted
        clock.now += 1.0
        core.poll()
    counted = {x: core.learners[x].tokens_accepted for x in ("late", "mallory")}
    clock.now += 2.0  # "late" last pushed fragment 1 five seconds ago, "mallory" too
    assert push(core, "late", s["late"], 2, steps=5 * H, tokens=5 * 600).accepted
    assert push(core, "mallory", s["mallory"], 2, steps=H, tokens=50 * 600).accepted
    core.poll()
    fragments = sum(1 for f in core.fragments if f.fragment.role == "params")
    late = (core.learners["late"].tokens_accepted - counted["late"]) * fragments
    mallory = (core.learners["mallory"].tokens_accepted - counted["mallory"]) * fragments
    assert late == pytest.approx(5 * 600)  # counted by H alone, 4 × 600 at most: the budget would overshoot
    assert mallory <= 4 * 600 * 5 + 1e-6  # 4 × the others' rate over its 5 s, not its 30,000 claimed


def test_a_free_rider_sending_zeros_is_merged_with_no_weight_and_no_tokens():
    core, clock = make_core(outer_momentum=0.0, outer_lr=1.0, scale_partial_rounds=False)
    s = {x: core.join(x, SPECS) for x in ("a", "rider")}
    before = core.fragments[1].outer_values().clone()
    assert push(core, "rider", s["rider"], 1, value=0.0, tokens=600 * 4).accepted  # claims 4× a's tokens
    assert push(core, "a", s["a"], 1, value=0.01).accepted
    core.poll()
    assert torch.allclose(before - core.fragments[1].outer_values(), torch.full((6,), 0.01))  # a's step, undiluted
    assert core.learners["rider"].tokens_accepted == 0 and core.learners["a"].tokens_accepted > 0
