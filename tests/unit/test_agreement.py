"""The agreement test (`SyncConfig.agreement_floor`, syncer/defences/agreement.py): each contribution against the
other contributions of its own round, under a fake clock. Honest learners push a shared direction plus their own
noise, as in tests/unit/test_direction_guard.py."""

import json

import pytest
import torch

from diloco.algorithm import codec
from diloco.algorithm.fragments import TensorSpec
from diloco.config import for_mode, validate
from diloco.syncer.defences import agreement
from diloco.syncer.replay import replay
from cores import Steps, core_in_memory, linspace

SPECS = [TensorSpec("emb", (8, 4), "float32", True), TensorSpec("w1", (64, 64), "float32"),
         TensorSpec("w2", (64,), "float32"), TensorSpec("w3", (64, 64), "float32")]
H = 6
F = 2  # a 4096-value fragment


def make_core(**overrides):
    settings = dict(sync_every=H, codec="int4", grace=0.0, grace_expect_steps=0.0, scale_partial_rounds=False,
                    agreement_floor=0.25)
    core, clock = core_in_memory(4, SPECS, linspace, **{**settings, **overrides})
    events = []
    core.on_event = lambda kind, fields: events.append({"event": kind, **fields})
    return core, clock, events


def one_round(core, clock, pushes: dict[str, torch.Tensor], seqs: dict[str, int], sessions) -> torch.Tensor:
    """Every learner of `pushes` pushes its Δ of fragment F into one round; the step the round took."""
    before = core.fragments[F].outer_values().clone()
    for lid, delta in pushes.items():
        seqs[lid] = seqs.get(lid, 0) + 1
        payload = codec.encode(delta, core.cfg.codec)
        assert core.push(lid, sessions[lid], seqs[lid], F, core.fragments[F].version, H, 600, payload).accepted
    clock.now += 1.0
    core.poll()
    return before - core.fragments[F].outer_values()


def contributors(events) -> dict[str, dict]:
    return {c["learner"]: c for c in [e for e in events if e["event"] == "round"][-1]["contributors"]}


def test_a_sign_flip_in_a_fragments_first_round_is_merged_with_no_weight():
    # the direction test passes a fragment's first rounds (its reference is not ready); the round itself tells
    steps = Steps(4096)
    honest = {lid: steps.honest() for lid in "abc"}
    flipped = -1.9 * steps.honest()
    moved = {}
    for name, floor in (("on", 0.25), ("off", 0.0), ("honest only", 0.25)):
        core, clock, events = make_core(agreement_floor=floor)
        pushes = dict(honest) if name == "honest only" else {**honest, "mallory": flipped}
        sessions = {lid: core.join(lid, SPECS) for lid in pushes}
        moved[name] = one_round(core, clock, pushes, {}, sessions)
        seen = contributors(events)
        if name == "on":
            assert seen["mallory"]["agreement"] == 0.0 and seen["mallory"]["weight"] == 0.0
            assert seen["mallory"]["agreement_score"] < -0.5
            assert all("agreement" not in seen[lid] and seen[lid]["agreement_score"] > 0.5 for lid in "abc")
            assert all("direction" not in c for c in seen.values())  # the direction test had nothing to go on
        if name == "off":
            assert all("agreement_score" not in c for c in seen.values())
    # merged without the flip: the step of the three honest learners alone (their payloads folded in anew)
    assert torch.allclose(moved["on"], moved["honest only"], atol=1e-6)
    assert (moved["off"] - moved["honest only"]).norm() > 0.1 * moved["honest only"].norm()


def test_a_credential_that_flips_some_pushes_loses_those_and_keeps_the_others():
    # its recent median is honest, so the direction test keeps its weight on a flip; the round does not
    core, clock, events = make_core(direction_floor=0.25)
    steps = Steps(4096)
    sessions = {lid: core.join(lid, SPECS) for lid in ("a", "b", "c", "mallory")}
    seqs: dict[str, int] = {}
    for r in range(8):
        flip = r in (4, 6)  # two of its last five pushes, fewer than half
        pushes = {lid: steps.honest() for lid in "abc"}
        pushes["mallory"] = -steps.honest() if flip else steps.honest()
        one_round(core, clock, pushes, seqs, sessions)
        m = contributors(events)["mallory"]
        if flip:
            assert m["agreement"] == 0.0 and "direction" not in m
        else:
            assert "agreement" not in m
    assert core.fragments[F].direction.ready


def test_a_round_of_one_is_judged_against_the_round_before():
    # a round closed on its first contribution (the grace window ended) still has the previous round to agree with
    core, clock, events = make_core()
    steps = Steps(4096)
    sessions = {lid: core.join(lid, SPECS) for lid in ("a", "b", "c", "mallory")}
    seqs: dict[str, int] = {}
    one_round(core, clock, {lid: steps.honest() for lid in "abc"}, seqs, sessions)
    assert one_round(core, clock, {"mallory": -1.9 * steps.honest()}, seqs, sessions).norm() == 0.0
    assert contributors(events)["mallory"]["agreement"] == 0.0
    # and an honest one after it: the flip in the round before is one voice of three
    honest = steps.honest()
    assert torch.allclose(one_round(core, clock, {"a": honest}, seqs, sessions),
                          codec.decode(codec.encode(honest, "int4")), atol=1e-6)
    assert "agreement" not in contributors(events)["a"] and contributors(events)["a"]["agreement_score"] > 0.5


def test_two_credentials_cannot_judge_each_other():
    core, clock, events = make_core()
    steps = Steps(4096)
    sessions = {lid: core.join(lid, SPECS) for lid in ("a", "mallory")}
    one_round(core, clock, {"a": steps.honest(), "mallory": -steps.honest()}, {}, sessions)
    assert all("agreement" not in c and "agreement_score" not in c for c in contributors(events).values())


def test_a_round_of_honest_learners_is_merged_as_without_the_test():
    steps = Steps(4096, seed=3)
    pushes = {lid: steps.honest() for lid in "abcd"}
    moved = []
    for floor in (0.25, 0.0):
        core, clock, events = make_core(agreement_floor=floor)
        sessions = {lid: core.join(lid, SPECS) for lid in pushes}
        moved.append(one_round(core, clock, pushes, {}, sessions))
    assert torch.equal(moved[0], moved[1])


def test_ids_of_one_credential_are_one_voice():
    # two ids of one hostile credential agree with each other; they count once, and cannot outvote two honest ones
    steps = Steps(20000, seed=1)
    flip = -steps.honest()
    verdicts = agreement.judge(["a", "b", "m", "m"], [agreement.sketch(d) for d in
                                                      (steps.honest(), steps.honest(), flip, flip.clone())], 0.25)
    assert [f for f, _ in verdicts] == [1.0, 1.0, 0.0, 0.0]


def test_nothing_is_judged_when_the_others_do_not_agree_among_themselves():
    gen = torch.Generator().manual_seed(2)
    noise = [torch.randn(20000, generator=gen) for _ in range(4)]
    verdicts = agreement.judge(list("abcd"), [agreement.sketch(d) for d in noise], 0.25)
    assert all(f == 1.0 for f, _ in verdicts)


@pytest.mark.parametrize("n", [1000, 4096, 300_001])
def test_a_sketch_keeps_cosines(n):
    gen = torch.Generator().manual_seed(n)
    common = torch.randn(n, generator=gen)
    x, y = common + torch.randn(n, generator=gen), common + torch.randn(n, generator=gen)
    true = torch.nn.functional.cosine_similarity(x, y, dim=0).item()
    est = agreement.cosines([agreement.sketch(x), agreement.sketch(y)])[0, 1].item()
    if n <= agreement.SKETCH:
        assert est == pytest.approx(true, abs=1e-3)  # every value in its own bucket: exact but for int8's rounding
    else:
        assert est == pytest.approx(true, abs=0.06)


def test_a_sketch_is_one_byte_a_value_and_a_zero_step_has_none():
    # what the test keeps per learner and fragment (a round's contributions, the last rounds' peers): int8
    s = agreement.sketch(torch.randn(50_000, generator=torch.Generator().manual_seed(3)))
    assert s.dtype == torch.int8 and s.numel() == agreement.SKETCH and s.abs().max().item() == 127
    assert not agreement.sketch(torch.zeros(50_000)).any()
    assert not agreement.sketch(torch.full((50_000,), float("inf"))).any()


def test_the_floor_is_checked_and_off_in_the_paper_preset():
    with pytest.raises(ValueError, match="--agreement-floor"):
        validate(for_mode("decoupled", 4, agreement_floor=1.5))
    assert for_mode("decoupled", 4, preset="paper").agreement_floor == 0.0


def test_replay_takes_the_recorded_factor_and_finds_one_that_was_changed():
    core, clock, events = make_core()
    steps = Steps(4096)
    sessions = {lid: core.join(lid, SPECS) for lid in ("a", "b", "c", "mallory")}
    seqs: dict[str, int] = {}
    for _ in range(3):
        weak = 0.1 * steps.honest() + steps.noise()  # along the others a little: 0 < factor < 1
        one_round(core, clock, {**{lid: steps.honest() for lid in "abc"}, "mallory": weak}, seqs, sessions)
    factors = [c["agreement"] for e in events if e["event"] == "round" for c in e["contributors"] if "agreement" in c]
    assert factors and all(0 < f < 1 for f in factors)
    tape = [{"event": "start", "config": json.loads(core.cfg.to_json())}, *events]
    assert replay(tape) == (3, [])
    for e in tape:
        for c in e.get("contributors", []):
            c.pop("agreement", None)  # a replay that ignored it would see other weights
    assert len(replay(tape)[1]) == 3
