"""A learner's push while its earlier push of the fragment is still pending (`SyncConfig.repeat_push`): replace, the rule of
docs/algorithm.md §4 (the newer contribution takes the older one's place in the round), against close (the round holding the
older one is closed first). docs/architecture.md, "A second push from a learner whose contribution is pending"."""

import argparse
import json
import math

import pytest
import torch

from diloco.algorithm import codec
from diloco.cli import add_sync_options, sync_overrides
from diloco.config import for_mode
from diloco.algorithm.merge import token_weight
from diloco.syncer.observation import memory
from diloco.syncer import rounds
from diloco.syncer.fragment_state import Contribution
from diloco.syncer.replay import replay
from diloco.syncer.observation.tape import Tape, read
from cores import SPECS, core_in_memory, linspace

H = 6
LR, MU = 0.7, 0.9


def make_core(repeat_push: str, learners: int = 2, **overrides):
    """Two learners, K = 2 (a first push stays pending), the plain weighted mean, fp32 pushes, DiLoCo's Nesterov
    outer step taken in full every round: a round's result is the formulas of docs/algorithm.md §4, computable by hand
    (no agreement test: its sketches would be open-round memory beside the kept Δs these tests count), and running
    sums while a round is open, whose kept Δs they count (tests/unit/test_merge_at_close.py: the same rounds)."""
    settings = dict(sync_every=H, codec="fp32", quorum=learners, merge="mean", outer_lr=LR, merge_at_close=False,
                    outer_momentum=MU, delayed_momentum=False, scale_partial_rounds=False, grace=0.0,
                    grace_expect_steps=0.0, clip_norm_ratio=0.0, max_counter_ratio=0.0, max_norm_ratio=0.0,
                    max_round_ratio=0.0, agreement_floor=0.0, repeat_push=repeat_push)
    core, clock = core_in_memory(learners, SPECS, linspace, **{**settings, **overrides})
    events = []
    core.on_event = lambda kind, fields: events.append((kind, fields))
    return core, clock, events


def delta(seed: int, n: int = 6, scale: float = 0.01) -> torch.Tensor:
    return scale * torch.randn(n, generator=torch.Generator().manual_seed(seed))


def push(core, lid, session, seq, d, steps, tokens, fragment=1, base_version=None):
    base = core.fragments[fragment].version if base_version is None else base_version
    return core.push(lid, session, seq, fragment, base, steps, tokens, codec.encode(d, "fp32"))


def rounds_of(events):
    return [fields for kind, fields in events if kind == "round"]


D1, D2, D3 = delta(1), delta(2), delta(3)
S1, T1, S2, T2, S3, T3 = 3, 300, 5, 520, 4, 350


def test_replace_merges_the_newer_push_in_the_older_ones_place_with_the_counters_it_carries():
    core, clock, events = make_core("replace")
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    theta0 = core.fragments[1].outer_values().clone()
    assert push(core, "a", sa, 1, D1, S1, T1).accepted
    assert core.poll() == [] and core.fragments[1].pending["a"].seq == 1  # K = 2: a's push waits for b
    clock.now += 0.5
    assert push(core, "a", sa, 2, D2, S2, T2).accepted  # same base, counters ≥ the first's: they cover its progress
    assert core.fragments[1].version == 0 and core.poll() == []  # nothing closed: the round is the same
    assert core.fragments[1].opened_at == 100.0 and list(core.fragments[1].pending) == ["a"]
    assert torch.equal(core.fragments[1].kept["a"][0], D2)
    clock.now += 0.5
    assert push(core, "b", sb, 1, D3, S3, T3).accepted
    pubs = core.poll()
    assert sorted((p.learner, p.seq) for p in pubs) == [("a", 2), ("b", 1)]  # a is answered for its newer push
    assert core.fragments[1].version == 1 and len(rounds_of(events)) == 1 and core.fragments[1].kept == {}
    # by hand: w = tokens²/steps with a's newer counters; Δ = Σ w Δ / Σ w; v = μ·0 + Δ; Θ ← Θ − η(Δ + μ·v)
    wa, wb = T2 * T2 / S2, T3 * T3 / S3
    merged = (wa * D2 + wb * D3) / (wa + wb)
    expected = theta0 - LR * (merged + MU * merged)
    assert torch.allclose(core.fragments[1].outer_values(), expected, atol=1e-7)
    # Δ1 played no part: with it in the round, or with the counters summed, the result differs
    w1 = T1 * T1 / S1
    with_d1 = theta0 - LR * (1 + MU) * (w1 * D1 + wa * D2 + wb * D3) / (w1 + wa + wb)
    summed = T1 + T2, S1 + S2
    wsum = summed[0] ** 2 / summed[1]
    with_sum = theta0 - LR * (1 + MU) * (wsum * D2 + wb * D3) / (wsum + wb)
    for other in (with_d1, with_sum):
        assert not torch.allclose(core.fragments[1].outer_values(), other, atol=1e-6)
    (round_,) = rounds_of(events)
    a, b = round_["contributors"]
    assert (a["learner"], a["steps"], a["tokens"], a["replaced"], a["since"]) == ("a", S2, T2, 1, 0.0)
    assert a["weight"] == pytest.approx(wa) and "replaced" not in b
    assert core.learners["a"].merged_seq == {f"{sa}:1": 2}  # a re-send of either push is a duplicate from here
    assert push(core, "a", sa, 1, D1, S1, T1).duplicate
    (replaced,) = [f for k, f in events if k == "replaced"]
    assert (replaced["seq"], replaced["replaced_seq"], replaced["counters"]) == (2, 1, "own")


def test_a_newer_push_that_restarted_its_counting_counts_with_the_sum_of_both():
    core, clock, events = make_core("replace")
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    theta0 = core.fragments[1].outer_values().clone()
    assert push(core, "a", sa, 1, D1, S1, T1).accepted
    assert push(core, "a", sa, 2, D2, 2, 180).accepted  # fewer steps than the push it replaces: counting restarted
    c = core.fragments[1].pending["a"]
    assert (c.steps, c.tokens, c.earlier) == (S1 + 2, T1 + 180, (S1, T1))
    assert push(core, "a", sa, 3, D1, 3, 330).accepted  # covers the second's own 2 steps: the first's stay beside
    c = core.fragments[1].pending["a"]
    assert (c.steps, c.tokens, c.replaced) == (S1 + 3, T1 + 330, 2)  # H steps: counted as they are
    assert push(core, "b", sb, 1, D3, S3, T3).accepted
    core.poll()
    wa, wb = (T1 + 330) ** 2 / (S1 + 3), T3 * T3 / S3
    expected = theta0 - LR * (1 + MU) * (wa * D1 + wb * D3) / (wa + wb)
    assert torch.allclose(core.fragments[1].outer_values(), expected, atol=1e-7)
    assert [f["counters"] for k, f in events if k == "replaced"] == ["sum", "sum"]


def test_the_counter_rule():
    older = Contribution("a", "s", 4, 7, 5, 500, 0)
    assert rounds.earlier_counters(older, "s", 7, 6, 600) == (0, 0)  # covers it: the newer's alone
    assert rounds.earlier_counters(older, "s", 7, 5, 500) == (0, 0)
    assert rounds.earlier_counters(older, "s", 7, 2, 600) == (5, 500)  # fewer steps: counting restarted
    assert rounds.earlier_counters(older, "s", 7, 6, 100) == (5, 500)  # fewer tokens
    assert rounds.earlier_counters(older, "s", 8, 9, 900) == (5, 500)  # another base: the learner resynchronised
    assert rounds.earlier_counters(older, "t", 7, 9, 900) == (5, 500)  # another session: a restarted process
    summed = Contribution("a", "s", 5, 7, 8, 800, 0, earlier=(5, 500))  # its own push: 3 steps, 300 tokens
    assert rounds.earlier_counters(summed, "s", 7, 4, 400) == (5, 500)
    assert rounds.earlier_counters(summed, "s", 7, 2, 400) == (8, 800)


def test_close_merges_the_older_push_in_a_round_of_its_own_first():
    core, clock, events = make_core("close")
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    theta0 = core.fragments[1].outer_values().clone()
    assert push(core, "a", sa, 1, D1, S1, T1).accepted
    assert push(core, "a", sa, 2, D2, S2, T2, base_version=0).accepted
    assert core.fragments[1].version == 1  # the round holding Δ1 closed, alone
    assert push(core, "b", sb, 1, D3, S3, T3).accepted
    pubs = core.poll()
    assert [(p.learner, p.version, p.seq) for p in pubs][0] == ("a", 1, 1)
    assert core.fragments[1].version == 2 and core.fragments[1].kept == {}
    first, second = rounds_of(events)
    assert first["decision"]["reason"] == "repeat" and [c["learner"] for c in first["contributors"]] == ["a"]
    assert [c["staleness"] for c in second["contributors"]] == [1, 0]
    # by hand: Δ1 alone, then Δ2 (which holds Δ1's progress too: merged twice) with Δ3
    v = D1.clone()
    theta = theta0 - LR * (D1 + MU * v)
    wa, wb = T2 * T2 / S2, T3 * T3 / S3
    merged = (wa * D2 + wb * D3) / (wa + wb)
    v = MU * v + merged
    theta = theta - LR * (merged + MU * v)
    assert torch.allclose(core.fragments[1].outer_values(), theta, atol=1e-7)


def test_the_paper_preset_replaces_and_the_default_closes():
    assert for_mode("decoupled", 4, preset="paper").repeat_push == "replace"
    assert for_mode("streaming", 4, preset="paper").repeat_push == "replace"
    assert for_mode("decoupled", 4).repeat_push == "close"
    p = argparse.ArgumentParser()
    add_sync_options(p)
    assert for_mode("decoupled", 2, **sync_overrides(p.parse_args(["--repeat-push", "replace"]))).repeat_push == "replace"
    assert for_mode("decoupled", 2, preset="paper",
                    **sync_overrides(p.parse_args(["--repeat-push", "close"]))).repeat_push == "close"
    with pytest.raises(ValueError, match="--repeat-push must be one of close, replace"):
        for_mode("decoupled", 2, repeat_push="sum")


def hostile_core(**overrides):
    """The default guards (counter ratio 4, the clip at 4×) after honest rounds of a, b and c on fragment 1."""
    core, clock, events = make_core("replace", learners=4, quorum=1, clip_norm_ratio=4.0, max_counter_ratio=4.0,
                                    **overrides)
    s = {x: core.join(x, SPECS) for x in ("a", "b", "c", "mallory")}
    for r in range(3):
        for i, x in enumerate("abc"):
            assert push(core, x, s[x], r + 1, torch.full((6,), 0.01 * (1 + 0.1 * i)), H, 600).accepted
        core.poll()
    return core, clock, s


@pytest.mark.parametrize("second", [(H, H * 2**32), (1, H * 2**32), (H, 10**15)])
def test_a_repeated_push_with_absurd_counters_is_bounded_like_a_first_push(second):
    steps, tokens = second
    core, clock, s = hostile_core()
    assert push(core, "mallory", s["mallory"], 1, torch.full((6,), 0.01), steps, tokens).accepted
    alone = core.fragments[1].pending["mallory"]
    core.poll()  # the round of mallory's first push alone, for comparison
    assert push(core, "mallory", s["mallory"], 2, torch.full((6,), 0.01), H, 600).accepted  # an honest first push
    accepted = core.learners["mallory"].tokens_accepted
    assert push(core, "mallory", s["mallory"], 3, torch.full((6,), 0.01), steps, tokens).accepted  # replaces it
    c = core.fragments[1].pending["mallory"]
    assert c.replaced == 1 and c.bounded
    assert c.counted == pytest.approx(alone.counted)  # the bound of a first push, whichever counter rule applied
    honest = token_weight(600, H)
    assert token_weight(*c.counted) <= 4**2 * honest * (1 + 1e-9)
    # and its tokens in the budget's bound grew by no more than one bounded push's share (every fragment trains)
    fragments = len(core.param_fragments)
    assert core.learners["mallory"].tokens_accepted - accepted <= alone.counted[0] / fragments + 1e-6


def test_repeating_a_push_gains_no_weight_and_no_tokens():
    core, clock, s = hostile_core()
    assert push(core, "mallory", s["mallory"], 1, torch.full((6,), 0.01), H, 600).accepted
    once = (core.fragments[1].pending["mallory"].counted, core.learners["mallory"].tokens_accepted)
    for seq in range(2, 6):
        assert push(core, "mallory", s["mallory"], seq, torch.full((6,), 0.01), H, 600).accepted
    assert (core.fragments[1].pending["mallory"].counted, core.learners["mallory"].tokens_accepted) == once
    assert len(core.fragments[1].pending) == 1 and core.fragments[1].merging.count == 1  # one contribution's sums
    resent = push(core, "mallory", s["mallory"], 3, torch.full((6,), 0.01), 2 * H, 600)  # older than the pending one
    assert resent.duplicate and "superseded" in resent.reason and core.fragments[1].pending["mallory"].seq == 5


def test_a_replacement_is_clipped_like_any_push():
    # the clip alone: the direction and agreement tests (on by default) would merge these flips with no weight at all
    core, clock, s = hostile_core(outer_momentum=0.0, outer_lr=1.0, direction_floor=0.0, agreement_floor=0.0)
    typical = core.fragments[1].guard.accepted.reference("mallory")
    before = core.fragments[1].outer_values().clone()
    assert push(core, "mallory", s["mallory"], 1, torch.full((6,), -0.5), H, 600).accepted  # clipped
    assert push(core, "mallory", s["mallory"], 2, torch.full((6,), -0.9), H, 600).accepted  # as large again
    core.poll()
    moved = (core.fragments[1].outer_values() - before).norm().item() / H
    assert moved == pytest.approx(4.0 * typical, rel=1e-4)  # merged at the clip, not at the replacement's size


def test_kept_deltas_count_as_open_round_memory_and_the_tape_replays(tmp_path):
    core, clock, events = make_core("replace", grace=1.0, quorum=1)
    tape = core.tape = Tape(tmp_path / "tape.jsonl")
    tape.record("start", config=json.loads(core.cfg.to_json()))
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    push(core, "a", sa, 1, D1, S1, T1)
    assert core.poll() == []
    open_bytes = memory.core_parts(core)["open_rounds"]
    assert open_bytes == 2 * 6 * 4  # the fp32 sum and a's kept Δ
    clock.now += 0.3
    push(core, "a", sa, 2, D2, S2, T2)
    assert memory.core_parts(core)["open_rounds"] == open_bytes  # replaced, not added
    clock.now += 0.3
    push(core, "b", sb, 1, D3, S3, T3)
    assert memory.core_parts(core)["open_rounds"] == 2 * open_bytes - 6 * 4
    assert core.poll() and memory.core_parts(core)["open_rounds"] == 0
    tape.close()
    events = read(tmp_path / "tape.jsonl")
    (round_,) = [e for e in events if e["event"] == "round"]
    assert [c["learner"] for c in round_["contributors"]] == ["a", "b"]  # the replaced push is no contributor
    assert replay(events) == (1, [])
    assert math.isclose(round_["contributors"][0]["at"], 0.3) and round_["contributors"][0]["since"] == 0.0
