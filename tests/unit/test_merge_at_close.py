"""`SyncConfig.merge_at_close`: an open round keeps its contributions' payloads, not running sums, and merges them
when it closes. The rounds it publishes are those of the running sums, with every defence that scales a
contribution (the clip, the agreement test) and with either repeat-push policy."""

import pytest
import torch

from diloco.algorithm import codec
from diloco.algorithm.fragments import TensorSpec
from diloco.syncer.core import SyncerCore
from diloco.syncer.observation import memory
from cores import Steps, core_in_memory, linspace

SPECS = [TensorSpec("emb", (8, 4), "float32", True), TensorSpec("w1", (64, 64), "float32"),
         TensorSpec("w2", (64,), "float32"), TensorSpec("w3", (64, 64), "float32")]
H, P = 6, 3


def train(merge_at_close: bool, rounds: int = 4, **settings) -> tuple[SyncerCore, list[dict]]:
    """Four learners push every fragment each round (one flips its sign, one sends a step 20× too long, one pushes
    twice in some rounds); the core and its round events."""
    core, clock = core_in_memory(4, SPECS, linspace, fragments=P, sync_every=H, codec="int4", grace=0.0,
                                 grace_expect_steps=0.0, merge_at_close=merge_at_close, **settings)
    events = []
    core.on_event = lambda kind, fields: events.append({"event": kind, **fields})
    sessions = {lid: core.join(lid, SPECS) for lid in ("a", "b", "c", "mallory")}
    steps = [Steps(fs.fragment.numel, seed=i) for i, fs in enumerate(core.fragments)]
    seq = 0
    for r in range(rounds):
        for p, fs in enumerate(core.fragments):
            for lid, session in sessions.items():
                delta = steps[p].honest()
                if lid == "mallory":
                    delta = -1.9 * delta if r % 2 else 20 * delta
                pushes = 2 if lid == "b" and r == 2 else 1  # a learner already in the round pushes again
                for _ in range(pushes):
                    seq += 1
                    payload = codec.encode(delta + 1e-4 * seq, "int4")
                    assert core.push(lid, session, seq, p, fs.version, H, 600, payload).accepted
        clock.now += 1.0
        core.poll(force=True)
    return core, [e for e in events if e["event"] == "round"]


@pytest.mark.parametrize("repeat_push", ["close", "replace"])
def test_rounds_merged_at_close_publish_what_running_sums_publish(repeat_push):
    streaming, rounds = train(False, repeat_push=repeat_push)
    at_close, rounds_at_close = train(True, repeat_push=repeat_push)
    # the defences judged alike: mallory's flips merged with no weight, its long steps clipped
    assert [[(c["learner"], c.get("agreement"), c["weight"]) for c in r["contributors"]] for r in rounds] == \
           [[(c["learner"], c.get("agreement"), c["weight"]) for c in r["contributors"]] for r in rounds_at_close]
    assert any(c.get("agreement") == 0.0 for r in rounds for c in r["contributors"])
    for fs, other in zip(streaming.fragments, at_close.fragments):
        assert fs.version == other.version >= 4
        # the same sums, folded in the same order, to float rounding (a contribution's norms are taken anew)
        moved = (fs.outer_values() - linspace(fs.fragment.numel)).abs().max().item()
        assert moved > 0.05
        assert (fs.outer_values() - other.outer_values()).abs().max().item() < 1e-4 * moved


@pytest.mark.parametrize("repeat_push", ["close", "replace"])
def test_an_open_round_merged_at_close_holds_payloads_and_no_sums(repeat_push):
    core, clock = core_in_memory(8, SPECS, linspace, fragments=P, sync_every=H, codec="int4", grace=0.0,
                                 agreement_floor=0.0, merge_at_close=True, repeat_push=repeat_push)
    sessions = {f"l{i}": core.join(f"l{i}", SPECS) for i in range(8)}
    steps = Steps(max(fs.fragment.numel for fs in core.fragments))
    kept = {}
    for p, fs in enumerate(core.fragments):
        # with replace, l0 pushes twice: its second push takes the first one's place, and no Δ is kept for it
        for seq, (lid, session) in enumerate([*sessions.items()] + ([("l0", sessions["l0"])] if repeat_push ==
                                                                     "replace" else [])):
            payload = codec.encode(steps.honest()[: fs.fragment.numel], "int4")
            kept[p, lid] = len(payload.data)  # a replaced push's payload is let go
            assert core.push(lid, session, 1 + seq, p, 0, H, 600, payload).accepted
    assert all(len(fs.pending) == 8 and fs.merging.sum is None and fs.merging.units is None and not fs.kept
               for fs in core.fragments)
    assert memory.core_parts(core)["open_rounds"] == sum(kept.values())  # an eighth of each Δ, and no fp32 sum
    assert core.kept_payloads.in_memory == sum(kept.values())  # what counts toward the budget: no replaced one
    assert len(core.poll(force=True)) > 0 and all(fs.version == 1 and not fs.pending for fs in core.fragments)
    assert core.kept_payloads.in_memory == 0
    assert memory.core_parts(core)["open_rounds"] == 0


def test_a_kept_payload_the_disk_gives_back_damaged_drops_its_round():
    core, clock = core_in_memory(3, SPECS, linspace, fragments=P, sync_every=H, codec="int4", grace=0.0,
                                 agreement_floor=0.0, merge_at_close=True)
    sessions = {lid: core.join(lid, SPECS) for lid in "abc"}
    fs = core.fragments[1]
    before = fs.outer_values().clone()
    steps = Steps(fs.fragment.numel)
    for lid, session in sessions.items():
        assert core.push(lid, session, 1, 1, 0, H, 600, codec.encode(steps.honest(), "int4")).accepted
    kept = fs.pending["b"].encoded
    kept.data[len(kept.data) // 2] ^= 0xFF  # the payload as the disk (or memory) gives it back, damaged
    events = []
    core.on_event = lambda kind, fields: events.append({"event": kind, **fields})
    core.poll(force=True)
    assert torch.equal(fs.outer_values(), before)  # nothing merged from a damaged payload
    assert not fs.pending
    assert any("could not be read back" in str(e) for e in events), events
