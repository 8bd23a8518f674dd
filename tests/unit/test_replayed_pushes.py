"""Verbatim replays (`SyncConfig.refuse_replays`, syncer/defences/replayed.py): a push whose payload repeats one
already accepted for its fragment is refused; resent pushes, all-zero payloads and the paper preset are not."""

import torch

from diloco.algorithm import codec
from diloco.algorithm.fragments import TensorSpec
from diloco.config import for_mode
from diloco.syncer.defences.replayed import MIN_VALUES, WINDOW, RecentPayloads, digest
from cores import core_in_memory

SPECS = [TensorSpec("emb", (64, 32), "float32", True), TensorSpec("w1", (64, 64), "float32"),
         TensorSpec("b1", (8,), "float32")]
F = 1  # 4,096 values


def payload(seed: int, numel: int) -> codec.Encoded:
    return codec.encode(1e-3 * torch.randn(numel, generator=torch.Generator().manual_seed(seed)), "int4")


def pusher(core):
    def push(lid, session, seq, data):
        return core.push(lid, session, seq, F, core.fragments[F].version, 6, 600, data)
    return push


def test_a_payload_repeated_byte_for_byte_is_refused_as_a_replay():
    core, clock = core_in_memory(2, SPECS, sync_every=6, codec="int4", refuse_replays=True,
                                 clip_norm_ratio=0.0)
    push = pusher(core)
    a, b = core.join("a", core.specs), core.join("b", core.specs)
    n = core.fragments[F].fragment.numel
    first = payload(0, n)
    assert push("a", a, 1, first).accepted
    core.poll(force=True)
    again = push("a", a, 2, first)  # the same bytes as new progress
    assert not again.accepted and again.resync and again.reason.startswith("replayed")
    assert core.refusals == {"replayed": 1}
    assert not push("b", b, 1, first).accepted  # whoever sends it
    assert push("a", a, 3, payload(1, n)).accepted  # new progress is merged


def test_a_resent_push_is_a_duplicate_and_zeros_repeat_freely():
    core, clock = core_in_memory(2, SPECS, sync_every=6, codec="int4", refuse_replays=True,
                                 clip_norm_ratio=0.0)
    push = pusher(core)
    a = core.join("a", core.specs)
    n = core.fragments[F].fragment.numel
    data = payload(0, n)
    assert push("a", a, 1, data).accepted
    resent = push("a", a, 1, data)  # its reply was lost: the same push again, the same sequence number
    assert resent.accepted and resent.duplicate
    zeros = codec.encode(torch.zeros(n), "int4")  # a fragment that did not move (frozen, or a free-rider)
    for seq in (2, 3, 4):
        core.poll(force=True)
        assert push("a", a, seq, zeros).accepted
    assert "replayed" not in core.refusals


def test_the_paper_preset_and_the_switch_accept_replays():
    assert for_mode("decoupled", 2, preset="paper").refuse_replays is False
    assert for_mode("decoupled", 2).refuse_replays is True
    core, clock = core_in_memory(2, SPECS, sync_every=6, codec="int4", refuse_replays=False,
                                 clip_norm_ratio=0.0)
    push = pusher(core)
    a = core.join("a", core.specs)
    data = payload(0, core.fragments[F].fragment.numel)
    assert push("a", a, 1, data).accepted
    core.poll(force=True)
    assert push("a", a, 2, data).accepted


def test_a_small_fragment_may_repeat():
    # four values' int4 levels and scale can come out the same twice when training moves slowly
    core, clock = core_in_memory(2, SPECS, sync_every=6, codec="int4", refuse_replays=True, clip_norm_ratio=0.0)
    a = core.join("a", core.specs)
    small = codec.encode(torch.full((8,), 1e-3), "int4")
    assert core.fragments[2].fragment.numel == 8 < MIN_VALUES
    for seq in (1, 2):
        assert core.push("a", a, seq, 2, core.fragments[2].version, 6, 600, small).accepted
        core.poll(force=True)


def test_the_window_keeps_the_latest_digests():
    recent = RecentPayloads()
    keys = [digest(bytes([i % 256, i // 256])) for i in range(WINDOW + 1)]
    for key in keys:
        recent.add(key)
    assert keys[0] not in recent and all(key in recent for key in keys[1:])
    recent.add(keys[1])  # seen again: the newest once more
    recent.add(digest(b"new"))
    assert keys[1] in recent and keys[2] not in recent
