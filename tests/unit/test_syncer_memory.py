"""The syncer's memory does not grow with the number of learners (docs/architecture.md, Syncer memory).

Memory is measured deterministically: the bytes of every tensor storage and byte string reachable from the core.
Each learner pushes one payload again and again, so verbatim replays are accepted here."""

from collections import deque
from dataclasses import fields, is_dataclass, replace

import pytest
import torch

from diloco.algorithm import codec
from diloco.config import for_mode
from diloco.algorithm.fragments import TensorSpec, plan_fragments
from diloco.syncer.defences import agreement
from diloco.syncer.observation import memory
from diloco.syncer.core import SyncerCore
from diloco.syncer.updates import UpdateQueue

P, NUMEL = 6, 1 << 20
FRAGMENT_BYTES = 4 * NUMEL
SPECS = [TensorSpec(f"w{i}", (1024, 1024), "float32") for i in range(P)]


def held_bytes(core) -> int:
    """Σ bytes of distinct tensor storages and byte strings reachable from the core's state (not its config)."""
    seen, storages, total = set(), set(), 0
    stack = [v for k, v in vars(core).items() if k not in ("cfg", "clock", "store")]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(x, (bytes, bytearray)):
            total += len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, deque)):
            stack.extend(x)
        elif is_dataclass(x):
            stack.extend(getattr(x, f.name) for f in fields(x))
        elif type(x).__module__.startswith("diloco"):
            stack.extend(vars(x).values())
    return total


def STANDING() -> float:  # noqa: N802
    """A clock that stands still: every push of a round arrives at the instant it opened, so the round takes them all
    (a push that arrives after a round was due opens the next one: SyncerCore._close_if_due) until the forced poll."""
    return 100.0


def peak_bytes(learners: int, rounds: int = 3, **overrides) -> int:
    """The most bytes the core held; its open rounds keep running sums unless `merge_at_close` is given."""
    cfg = for_mode("decoupled", learners, fragments=P, sync_every=P, codec="int4", down_codec="int8", grace=0.0,
                   refuse_replays=False, **{"merge_at_close": False, **overrides})
    core = SyncerCore(cfg, clock=STANDING)
    core.initialize(SPECS, [torch.zeros(f.numel) for f in plan_fragments(SPECS, P)])
    sessions = {f"l{i}": core.join(f"l{i}", SPECS) for i in range(learners)}
    g = torch.Generator().manual_seed(0)
    payloads = {lid: codec.encode(torch.randn(NUMEL, generator=g) * 1e-3, "int4") for lid in sessions}
    peak, seq = held_bytes(core), 0
    for r in range(rounds):
        seq += 1
        # every fragment's round is open at once, with every learner in it (half of them skip a round and fall
        # behind: their next results come as chains of changes or full values)
        for p in range(P):
            for i, (lid, session) in enumerate(sessions.items()):
                if r == 1 and i % 2:
                    continue
                result = core.push(lid, session, seq, p, core.fragments[p].version, P, 100 * P, payloads[lid])
                assert result.accepted, result.reason
        peak = max(peak, held_bytes(core))
        publications = core.poll(force=True)
        assert publications and all(f.version == r + 1 for f in core.fragments)
        peak = max(peak, held_bytes(core))
    return peak


def test_syncer_memory_does_not_grow_with_the_number_of_learners():
    # without the agreement test, which keeps each open round's payloads (the next test)
    two, sixteen = peak_bytes(2, agreement_floor=0.0), peak_bytes(16, agreement_floor=0.0)
    # before: a full fp32 copy of the model per learner plus one Δ per pending contribution (28 models more); now
    # the difference is at most the pool of reused buffers (one fragment: with two learners a round's second
    # contribution becomes its sum, with more the third's buffer is folded in and kept for reuse)
    assert sixteen - two <= FRAGMENT_BYTES, (two, sixteen)
    # P, Θ − P in bf16, the int8 changes some learner misses, the open rounds' sums (one per fragment), the reused
    # buffers and the direction test's reference in bf16; with μ = 0, the decoupled default, no momentum or
    # delayed-momentum sum (2 models more)
    assert two < 3.7 * P * FRAGMENT_BYTES, two / (P * FRAGMENT_BYTES)
    without_direction = peak_bytes(2, direction_floor=0.0, agreement_floor=0.0)
    assert 0.45 * P * FRAGMENT_BYTES < two - without_direction < 0.55 * P * FRAGMENT_BYTES, \
        (two - without_direction) / (P * FRAGMENT_BYTES)
    with_momentum = peak_bytes(2, outer_momentum=0.9, agreement_floor=0.0)
    assert 1.9 * P * FRAGMENT_BYTES < with_momentum - two < 2.1 * P * FRAGMENT_BYTES, (with_momentum - two) / (P * FRAGMENT_BYTES)


@pytest.mark.parametrize("change_buffer", [None, 0.1])
def test_changes_kept_for_lagging_learners_stay_within_the_change_buffer(change_buffer):
    cfg = for_mode("decoupled", 8, fragments=P, sync_every=P, codec="int4", down_codec="int8", grace=0.0,
                   refuse_replays=False, agreement_floor=0.0)
    core = SyncerCore(cfg, clock=STANDING)
    core.change_buffer = change_buffer
    core.initialize(SPECS, [torch.zeros(f.numel) for f in plan_fragments(SPECS, P)])
    sessions = {f"l{i}": core.join(f"l{i}", SPECS) for i in range(8)}
    g = torch.Generator().manual_seed(0)
    payload = codec.encode(torch.randn(NUMEL, generator=g) * 1e-3, "int4")
    most = 0
    for r in range(4):  # l7, live, never pushes: it lags on every fragment by one more version each round
        for p in range(P):
            for lid, session in sessions.items():
                if lid != "l7":
                    assert core.push(lid, session, r + 1, p, core.fragments[p].version, P, 100 * P, payload).accepted
        core.poll(force=True)
        most = max(most, memory.core_parts(core)["changes"])
    if change_buffer is None:  # the window alone: up to the model (a chain is kept while smaller than full values)
        assert most >= 0.7 * P * FRAGMENT_BYTES, most / (P * FRAGMENT_BYTES)
    else:
        assert most <= change_buffer * P * FRAGMENT_BYTES, most / (P * FRAGMENT_BYTES)


def test_rounds_merged_at_close_hold_no_sums_and_a_payload_per_contribution():
    # every fragment's round open at once with every learner in it: no fp32 sums, only each contribution's payload
    # (one per learner here: each pushes one payload to every fragment), which a server keeps in memory up to its
    # --agreement-buffer and on disk beyond
    payload = len(codec.encode(torch.zeros(NUMEL), "int4").data)
    two, sixteen = (peak_bytes(m, merge_at_close=True, agreement_floor=0.0) for m in (2, 16))
    assert 14 * payload <= sixteen - two <= 14 * payload + FRAGMENT_BYTES, (sixteen - two) / payload
    streaming = peak_bytes(16, agreement_floor=0.0)  # a running sum per fragment instead of the payloads
    assert streaming - sixteen >= P * FRAGMENT_BYTES - 16 * payload, (streaming - sixteen) / FRAGMENT_BYTES


def test_the_agreement_test_keeps_a_payload_and_a_sketch_per_contribution_of_an_open_round():
    # each learner here pushes one int4 payload to all P fragments: one payload per learner, and its sketch in each
    # fragment's open round and among the fragment's peers (the last rounds' latest per credential)
    payload = len(codec.encode(torch.zeros(NUMEL), "int4").data)  # an eighth of the fragment, and its scales
    sketches = 2 * P * agreement.SKETCH  # int8
    off, on = peak_bytes(16, agreement_floor=0.0), peak_bytes(16)
    assert 16 * payload <= on - off <= 16 * (payload + sketches) + FRAGMENT_BYTES, (on - off) / (16 * payload)


def test_without_rdas_mean_fallback_an_open_round_keeps_one_running_sum():
    # every fragment's round open with two contributions: Σ w·Δ beside Σ w·unit(Δ) is one model more, and without
    # the fallback the second contribution's buffer becomes the one sum (one fragment fewer left in the pool)
    paper, ours = peak_bytes(2, rda_mean_fallback=True), peak_bytes(2, rda_mean_fallback=False)
    expected = (P + 1) * FRAGMENT_BYTES
    assert 0.95 * expected < paper - ours < 1.05 * expected, (paper - ours) / (P * FRAGMENT_BYTES)


def test_theta_as_published_values_and_a_bf16_residual_saves_half_a_model():
    fp32, bf16 = peak_bytes(2, bf16_residual=False), peak_bytes(2)
    assert 0.45 * P * FRAGMENT_BYTES < fp32 - bf16 < 0.55 * P * FRAGMENT_BYTES, (fp32 - bf16) / (P * FRAGMENT_BYTES)


def test_a_round_waiting_for_its_second_contribution_holds_the_first_one_encoded():
    cfg = for_mode("decoupled", 2, fragments=P, sync_every=P, codec="int4", down_codec="int8", grace=0.0,
                   refuse_replays=False)
    core = SyncerCore(cfg)
    core.initialize(SPECS, [torch.zeros(f.numel) for f in plan_fragments(SPECS, P)])
    sessions = {f"l{i}": core.join(f"l{i}", SPECS) for i in range(2)}
    before = held_bytes(core)
    payload = codec.encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * 1e-3, "int4")
    for p in range(P):  # every fragment's round opened by one learner, the other still to come
        assert core.push("l0", sessions["l0"], 1, p, 0, P, 100 * P, payload).accepted
    assert all(fs.pending for fs in core.fragments)
    # the int4 payload (shared here) and at most one reused fp32 buffer, not P fragments of fp32 sums (and the
    # agreement test's sketch of each contribution)
    assert held_bytes(core) - before <= len(payload.data) + FRAGMENT_BYTES + P * agreement.SKETCH * 4


@pytest.mark.parametrize("agreement_floor", [0.0, 0.25])  # the agreement test keeps sketches and payloads
@pytest.mark.parametrize("merge_at_close", [False, True])  # running sums, or payloads merged when rounds close
def test_the_memory_report_accounts_for_what_the_core_holds(agreement_floor, merge_at_close):
    cfg = for_mode("decoupled", 3, fragments=P, sync_every=P, codec="int4", down_codec="int8", grace=0.0,
                   refuse_replays=False, agreement_floor=agreement_floor, merge_at_close=merge_at_close)
    core = SyncerCore(cfg, clock=STANDING)
    core.initialize(SPECS, [torch.zeros(f.numel) for f in plan_fragments(SPECS, P)])
    sessions = {f"l{i}": core.join(f"l{i}", SPECS) for i in range(3)}
    g = torch.Generator().manual_seed(0)
    seq = 0
    for r in range(3):
        seq += 1
        for p in range(P):
            for lid, session in list(sessions.items())[: 2 if r == 1 else 3]:  # l2 misses a round: a chain of two
                payload = codec.encode(torch.randn(NUMEL, generator=g) * 1e-3, "int4")
                assert core.push(lid, session, seq, p, core.fragments[p].version, P, 100 * P, payload).accepted
        parts = memory.core_parts(core)
        if merge_at_close:  # each contribution's payload (an eighth of its fragment), no sums
            assert all(fs.merging.sum is None for fs in core.fragments if fs.merging is not None)
            assert 0 < parts["open_rounds"] < P * FRAGMENT_BYTES / 2
        else:
            assert parts["open_rounds"] >= P * FRAGMENT_BYTES  # every round has a running sum
        assert sum(parts.values()) == held_bytes(core), (parts, held_bytes(core))
        publications = core.poll(force=True)
        parts = memory.core_parts(core)
        assert parts["open_rounds"] == 0 and (parts["changes"] > 0) == (r == 1)  # what l2 misses, then nothing
        assert sum(parts.values()) == held_bytes(core), (parts, held_bytes(core))
        if r == 1:
            kept = publications
    # answers waiting to be sent count only where the core no longer keeps them: full values, dropped changes
    queue = UpdateQueue(100)
    for pub in kept:  # changes the window no longer keeps
        queue.put_nowait(pub)
    full = codec.encode(core.fragments[0].values, "fp32")
    queue.put_nowait(replace(kept[0], fragment=1, payload=full, full=True))
    dropped = {id(pub.payload): len(pub.payload.data) for pub in kept if pub.fragment != 1}  # 1's: superseded
    assert memory.queued_bytes([queue], memory.kept_change_ids(core)) == sum(dropped.values()) + len(full.data)
    assert memory.queued_bytes([queue], {id(pub.payload) for pub in kept}) == len(full.data)
    # what update streams are sending counts once, and only where no queue or the core holds it already
    sending = codec.encode(torch.ones(NUMEL), "fp32")
    assert memory.sending_bytes([sending, sending, full], [queue], set()) == len(sending.data)
    assert memory.sending_bytes([kept[0].payload], [], {id(kept[0].payload)}) == 0


def test_what_malloc_holds_beside_the_parts_is_split_into_other_heap_and_kept_free():
    parts = {"model": 60, "changes": 15}
    assert memory.with_heap(parts, (100, 7)) == {**parts, "other_heap": 25, "allocator_free": 7}
    assert memory.with_heap(parts, None) == {**parts, "other_heap": 0, "allocator_free": 0}  # malloc not asked
