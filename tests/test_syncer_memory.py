"""The syncer's memory does not grow with the number of learners (docs/architecture.md, Syncer memory).

Memory is measured deterministically: the bytes of every tensor storage and byte string reachable from the core."""

from collections import deque
from dataclasses import fields, is_dataclass

import torch

from diloco import codec
from diloco.config import for_mode
from diloco.fragments import TensorSpec, plan_fragments
from diloco.syncer.core import SyncerCore

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


def peak_bytes(learners: int, rounds: int = 3, **overrides) -> int:
    cfg = for_mode("decoupled", learners, fragments=P, sync_every=P, codec="int4", down_codec="int8", grace=0.0,
                   **overrides)
    core = SyncerCore(cfg)
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
    two, sixteen = peak_bytes(2), peak_bytes(16)
    # before: a full fp32 copy of the model per learner plus one Δ per pending contribution (28 models more)
    assert sixteen - two < FRAGMENT_BYTES, (two, sixteen)
    # P, Θ − P in bf16, the int8 changes some learner misses, the open rounds' sums (one per fragment) and the
    # reused buffers; with μ = 0, the decoupled default, no momentum or delayed-momentum sum (2 models more)
    assert two < 3.2 * P * FRAGMENT_BYTES, two / (P * FRAGMENT_BYTES)
    with_momentum = peak_bytes(2, outer_momentum=0.9)
    assert 1.9 * P * FRAGMENT_BYTES < with_momentum - two < 2.1 * P * FRAGMENT_BYTES, (with_momentum - two) / (P * FRAGMENT_BYTES)


def test_without_rdas_mean_fallback_an_open_round_keeps_one_running_sum():
    # every fragment's round open with two contributions: Σ w·Δ beside Σ w·unit(Δ) is one model more
    paper, ours = peak_bytes(2, rda_mean_fallback=True), peak_bytes(2, rda_mean_fallback=False)
    assert 0.95 * P * FRAGMENT_BYTES < paper - ours < 1.05 * P * FRAGMENT_BYTES, (paper - ours) / (P * FRAGMENT_BYTES)


def test_theta_as_published_values_and_a_bf16_residual_saves_half_a_model():
    fp32, bf16 = peak_bytes(2, bf16_residual=False), peak_bytes(2)
    assert 0.45 * P * FRAGMENT_BYTES < fp32 - bf16 < 0.55 * P * FRAGMENT_BYTES, (fp32 - bf16) / (P * FRAGMENT_BYTES)


def test_a_round_waiting_for_its_second_contribution_holds_the_first_one_encoded():
    cfg = for_mode("decoupled", 2, fragments=P, sync_every=P, codec="int4", down_codec="int8", grace=0.0)
    core = SyncerCore(cfg)
    core.initialize(SPECS, [torch.zeros(f.numel) for f in plan_fragments(SPECS, P)])
    sessions = {f"l{i}": core.join(f"l{i}", SPECS) for i in range(2)}
    before = held_bytes(core)
    payload = codec.encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * 1e-3, "int4")
    for p in range(P):  # every fragment's round opened by one learner, the other still to come
        assert core.push("l0", sessions["l0"], 1, p, 0, P, 100 * P, payload).accepted
    assert all(fs.pending for fs in core.fragments)
    # the int4 payload (shared here) and at most one reused fp32 buffer, not P fragments of fp32 sums
    assert held_bytes(core) - before <= len(payload.data) + FRAGMENT_BYTES
