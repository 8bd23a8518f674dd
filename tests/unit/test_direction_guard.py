"""The direction test (`SyncConfig.direction_floor`, syncer/defences/direction_guard.py): a contribution against the
fragment's recent published steps, under a fake clock. Honest learners here push a shared training direction plus
their own noise (cosine about 0.8 with the reference), as real learners' outer gradients share the descent."""

import json
import math

import pytest
import torch

from diloco.algorithm import codec
from diloco.config import for_mode
from diloco.algorithm.fragments import TensorSpec
from diloco.syncer.defences.direction_guard import DirectionGuard
from diloco.syncer.replay import replay
from cores import Steps, core_in_memory, linspace

SPECS = [TensorSpec("emb", (8, 4), "float32", True), TensorSpec("w1", (64, 64), "float32"),
         TensorSpec("w2", (64,), "float32"), TensorSpec("w3", (64, 64), "float32")]
H = 6
F = 2  # a 4096-value fragment: noise has a cosine of about 1/64 with anything


def make_core(**overrides):
    # the direction test alone: the agreement test (tests/unit/test_agreement.py) would also judge these pushes
    settings = dict(sync_every=H, codec="fp32", grace=0.0, grace_expect_steps=0.0, scale_partial_rounds=False,
                    direction_floor=0.25, agreement_floor=0.0)
    core, clock = core_in_memory(4, SPECS, linspace, **{**settings, **overrides})
    events = []
    core.on_event = lambda kind, fields: events.append({"event": kind, **fields})
    return core, clock, events


def push(core, lid, session, seq, delta, fragment=F):
    return core.push(lid, session, seq, fragment, core.fragments[fragment].version, H, 600, codec.encode(delta, "fp32"))


def step_of(core, clock, lid, session, seq, delta, fragment=F) -> torch.Tensor:
    """Push `delta` alone in a round and return the step the round took (decoupled: Θ ← Θ − Δ_merged)."""
    before = core.fragments[fragment].outer_values().clone()
    assert push(core, lid, session, seq, delta, fragment).accepted
    clock.now += 1.0
    core.poll()
    return before - core.fragments[fragment].outer_values()


def last_contributor(events, learner):
    (c,) = [c for c in [e for e in events if e["event"] == "round"][-1]["contributors"] if c["learner"] == learner]
    return c


def warm(core, clock, steps, sessions, rounds_=3, start=1):
    """Honest rounds, one contributor each, every learner of `sessions` in turn."""
    for r in range(rounds_):
        for lid, s in sessions.items():
            step_of(core, clock, lid, s, start + r, steps.honest())


def test_a_sign_flipped_contribution_gets_no_weight_once_a_reference_exists():
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in ("a", "b", "c", "mallory")}
    warm(core, clock, steps, {x: s[x] for x in "abc"})
    flipped = -steps.honest()
    moved = step_of(core, clock, "mallory", s["mallory"], 1, flipped)
    assert moved.norm().item() == 0.0  # merged alone with factor 0: the round takes no step
    m = last_contributor(events, "mallory")
    assert m["cosine"] < -0.5 and m["direction"] == 0.0 and m["weight"] == 0.0
    # in a round with an honest contribution, the flip takes nothing of the merged direction
    honest = steps.honest()
    before = core.fragments[F].outer_values().clone()
    assert push(core, "a", s["a"], 10, honest).accepted
    assert push(core, "mallory", s["mallory"], 2, -steps.honest()).accepted
    clock.now += 1.0
    core.poll()
    assert len([e for e in events if e["event"] == "round"][-1]["contributors"]) == 2
    assert torch.allclose(before - core.fragments[F].outer_values(), honest, atol=1e-6)


def test_an_honest_contribution_keeps_its_full_weight():
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in "abc"}
    warm(core, clock, steps, s)
    for seq, lid in enumerate("abcabc", start=10):
        honest = steps.honest()
        assert torch.allclose(step_of(core, clock, lid, s[lid], seq, honest), honest, atol=1e-6)
        c = last_contributor(events, lid)
        assert c["cosine"] > 0.5 and "direction" not in c
        assert c["weight"] == pytest.approx(600**2 / H)


def test_an_honest_learner_s_step_against_the_reference_keeps_its_weight():
    # honest steps point against r now and then (an outer step that overshot, taken back): judged by its
    # credential's recent median, such a step is merged in full, while a credential that does so always is not
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in "abc"}
    warm(core, clock, steps, s, rounds_=5)  # r ready after 4 rounds: three cosines of each learner since
    back = -steps.honest()
    assert torch.allclose(step_of(core, clock, "a", s["a"], 10, back), back, atol=1e-6)
    a = last_contributor(events, "a")
    assert a["cosine"] < -0.5 and "direction" not in a
    for seq in (11, 12):
        for lid in "bc":
            step_of(core, clock, lid, s[lid], seq, steps.honest())
        step_of(core, clock, "a", s["a"], seq, -steps.honest())
    assert last_contributor(events, "a")["direction"] == 0.0  # three of its last five against r


def test_noise_is_merged_with_near_zero_weight():
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in ("a", "b", "c", "mallory")}
    warm(core, clock, steps, {x: s[x] for x in "abc"})
    for seq in range(1, 6):
        noise = steps.noise()
        moved = step_of(core, clock, "mallory", s["mallory"], seq, noise)
        assert moved.norm().item() < 0.3 * noise.norm().item()
        assert last_contributor(events, "mallory")["direction"] < 0.3


def test_the_first_rounds_pass_whatever_their_direction():
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in ("a", "mallory")}
    flipped = -steps.honest()
    # no round published yet: no reference, merged in full
    assert torch.allclose(step_of(core, clock, "mallory", s["mallory"], 1, flipped), flipped, atol=1e-6)
    m = last_contributor(events, "mallory")
    assert "cosine" not in m and "direction" not in m
    # a reference, but no other credential has a cosine yet: a's push is measured, not judged
    honest = steps.honest()
    assert torch.allclose(step_of(core, clock, "a", s["a"], 1, honest), honest, atol=1e-6)
    a = last_contributor(events, "a")
    assert a["cosine"] < 0 and "direction" not in a


def test_a_reference_a_hostile_party_made_first_is_remade_by_the_others():
    # the hostile learner's flipped push is the fragment's first round: r points the wrong way, and the honest
    # learners' cosines with it start negative. Their typical cosine, not positive, lets everything pass until
    # their merged rounds have turned r; from then on the flips are merged with no weight
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in ("mallory", "a", "b", "c")}
    step_of(core, clock, "mallory", s["mallory"], 1, -steps.honest())
    for r in range(2, 8):
        for lid in "abc":
            step_of(core, clock, lid, s[lid], r, steps.honest())
        step_of(core, clock, "mallory", s["mallory"], r, -steps.honest())
    assert last_contributor(events, "mallory")["direction"] == 0.0
    for lid in "abc":
        step_of(core, clock, lid, s[lid], 20, steps.honest())
        assert "direction" not in last_contributor(events, lid)


def test_many_ids_of_one_credential_count_once_in_the_typical_cosine():
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in "abc"}
    warm(core, clock, steps, s)
    m = {x: core.join(x, SPECS, credential="mallory") for x in ("m1", "m2", "m3", "m4")}
    for seq in (1, 2, 3):
        for lid, session in m.items():  # as four credentials, the fourth id would make the others' typical ≈ 0
            step_of(core, clock, lid, session, seq, -steps.honest())
            assert last_contributor(events, lid)["direction"] == 0.0
        for lid in "abc":
            step_of(core, clock, lid, s[lid], 10 + seq, steps.honest())
            assert "direction" not in last_contributor(events, lid)
    assert core.fragments[F].direction.cosines.credentials() == {"a", "b", "c", "mallory"}


def test_the_paper_preset_and_the_switch_off_merge_a_sign_flip_in_full():
    for core, clock, events in (make_core(direction_floor=0.0), make_core(preset="paper", direction_floor=None,
                                                                          outer_momentum=0.0, outer_lr=1.0)):
        assert all(fs.direction is None for fs in core.fragments)
        steps = Steps(core.fragments[F].fragment.numel)
        s = {x: core.join(x, SPECS) for x in ("a", "b", "c", "mallory")}
        warm(core, clock, steps, {x: s[x] for x in "abc"})
        flipped = -steps.honest()
        assert torch.allclose(step_of(core, clock, "mallory", s["mallory"], 1, flipped), flipped, atol=1e-6)
        m = last_contributor(events, "mallory")
        assert "cosine" not in m and "direction" not in m
    assert for_mode("decoupled", 4, preset="paper").direction_floor == 0.0


def test_replay_takes_the_recorded_factor_and_finds_one_that_was_changed():
    core, clock, events = make_core()
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in ("a", "b", "mallory")}
    warm(core, clock, steps, {x: s[x] for x in "ab"})
    for seq in (1, 2):
        weak = 0.1 * steps.honest() + steps.noise()  # a cosine of about 0.08: 0 < factor < 1
        step_of(core, clock, "mallory", s["mallory"], seq, weak)
        step_of(core, clock, "a", s["a"], 10 + seq, steps.honest())
    factors = [c["direction"] for e in events if e["event"] == "round" for c in e["contributors"] if "direction" in c]
    assert factors and any(0 < f < 1 for f in factors)
    tape = [{"event": "start", "config": json.loads(core.cfg.to_json())}, *events]
    def weights_differ(tape) -> list:
        replayed, differences = replay(tape)
        assert replayed > 0
        return [d for d in differences if "weight" in d.what]

    assert weights_differ(tape) == []
    for e in tape:
        for c in e.get("contributors", []):
            c.pop("direction", None)  # a replay that ignored it would see other weights
    assert weights_differ(tape)


def ready(guard: DirectionGuard) -> DirectionGuard:
    """`guard` once r has taken in the rounds it needs before judging (three credentials' rounds, four rounds)."""
    for who in ("a", "b", "c", "a"):
        guard.published(torch.zeros(guard.numel), {who})
    assert guard.ready
    return guard


def test_the_reference_is_a_decaying_sum_of_published_steps_in_bf16():
    guard = DirectionGuard(8, 0.25)
    assert guard.cosine(torch.ones(8), math.sqrt(8)) is None  # nothing published yet
    guard.published(torch.ones(8), {"a"})
    guard.published(torch.tensor([1.0, -1.0] * 4), {"b"})
    assert guard.reference.dtype == torch.bfloat16
    assert torch.equal(guard.reference.float(), torch.tensor([1.5, -0.5] * 4))
    assert guard.cosine(torch.tensor([1.0, 0.0] * 4), 2.0) == pytest.approx(1.5 / math.sqrt(2.5), rel=1e-3)
    assert guard.cosine(torch.zeros(8), 0.0) is None  # a zero Δ (a free-rider) is not measured


def test_nothing_is_judged_until_r_took_in_rounds_of_three_credentials():
    guard = DirectionGuard(8, 0.25)
    for _ in range(6):  # however many rounds one or two parties push
        guard.published(torch.ones(8), {"mallory", "a"})
        assert guard.judge("b", -0.9) == 1.0 and len(guard.cosines.credentials()) == 0
    guard.published(torch.ones(8), {"c"})
    assert guard.ready


def test_the_factor_is_the_credential_s_median_over_the_others_typical():
    guard = ready(DirectionGuard(8, 0.25))
    assert guard.judge("mallory", -0.9) == 1.0  # no other credential yet
    for _ in range(3):
        assert guard.judge("a", 0.4) == 1.0
    guard.judge("c", 0.4)
    assert guard.judge("mallory", -0.9) == 0.0
    assert guard.judge("mallory", 0.3) == 0.0  # positive, but its credential's median is not
    assert guard.judge("b", 0.05) == pytest.approx(0.05 / (0.25 * 0.4))  # a first cosine is its own median
    assert guard.judge("b", 0.3) == 1.0  # the median of 0.05 and 0.3 is over 0.25 × 0.4
    assert guard.judge("b", -0.5) == pytest.approx(0.05 / (0.25 * 0.4))  # one against r: judged by the median


def test_when_the_others_do_not_follow_r_everything_passes_and_cosines_are_forgotten():
    # a hostile party's rounds made r: honest credentials' cosines are near 0 or below, its own high
    guard = ready(DirectionGuard(8, 0.25))
    for who, cos in (("a", 0.05), ("c", 0.08), ("mallory", 0.6)):
        guard.cosines.add(who, cos)
    assert guard.judge("b", -0.1) == 1.0 and guard.forgotten == 1  # a's, c's and mallory's 0.6 gone with b's
    assert guard.cosines.credentials() == set()
    for who in "ac":
        guard.judge(who, 0.3)  # r remade by everyone's rounds: the others follow it again
    assert guard.judge("mallory", -0.5) == 0.0  # judged by what it pushes now, not by its 0.6


def test_the_reference_costs_half_a_fragment_per_parameter_fragment_and_is_reported():
    from diloco.syncer.observation import memory
    core, clock, events = make_core()
    steps = {p: Steps(core.fragments[p].fragment.numel, seed=p) for p in range(3)}
    s = {x: core.join(x, SPECS) for x in "ab"}
    for p in range(3):
        for seq, lid in ((1, "a"), (1, "b")):
            step_of(core, clock, lid, s[lid], seq, steps[p].honest(), fragment=p)
    numel = sum(fs.fragment.numel for fs in core.fragments)
    assert sum(fs.direction.reference.numel() * 2 for fs in core.fragments) == 2 * numel  # bf16: half of fp32
    assert memory.core_parts(core)["outer_state"] == 2 * numel  # μ = 0: the references are the whole outer state
    off, _, _ = make_core(direction_floor=0.0)
    assert memory.core_parts(off)["outer_state"] == 0


def test_a_restarted_syncer_has_the_test_and_warms_its_reference_up_again(tmp_path):
    from diloco.syncer.at_rest.store import StateStore

    core, clock, events = make_core()
    core.store = StateStore(tmp_path)
    core.persist(range(len(core.fragments)))
    steps = Steps(core.fragments[F].fragment.numel)
    s = {x: core.join(x, SPECS) for x in "abc"}
    warm(core, clock, steps, s)
    assert core.fragments[F].direction.ready
    again, clock, events = make_core()
    again.store = StateStore(tmp_path)
    assert again.restore()
    assert all(fs.direction is not None and fs.direction.reference is None for fs in again.fragments)
    # until its reference has taken in rounds of three credentials again, a flip passes
    s = {x: again.join(x, SPECS) for x in ("a", "mallory")}
    flipped = -steps.honest()
    assert torch.allclose(step_of(again, clock, "mallory", s["mallory"], 1, flipped), flipped, atol=1e-6)
