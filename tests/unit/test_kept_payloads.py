"""The agreement test's payloads of open rounds (syncer/kept_payloads.py): in memory up to a share of the model,
beyond it in an unnamed file per fragment, emptied when the round closes; a round that folds a contribution in anew
reads it back and merges exactly as from memory, and a payload the disk gave back damaged drops the round."""

import logging

import torch

from diloco.algorithm import codec
from diloco.algorithm.fragments import TensorSpec
from diloco.syncer.kept_payloads import KeptPayloads, Spilled
from cores import Steps, core_in_memory, linspace

SPECS = [TensorSpec("emb", (8, 4), "float32", True), TensorSpec("w1", (64, 64), "float32"),
         TensorSpec("w2", (64,), "float32"), TensorSpec("w3", (64, 64), "float32")]
F = 2  # a 4096-value fragment


def payload(n: int, seed: int) -> codec.Encoded:
    return codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(seed)), "int4")


def test_payloads_beyond_the_budget_wait_on_disk_and_come_back_as_they_were(tmp_path):
    kept = KeptPayloads(share=0.25, folder=tmp_path)
    model_bytes = 4 * 40_000  # the budget: 40,000 bytes; an int4 payload of 40,000 values is 21,250
    first, second, third = payload(40_000, 0), payload(40_000, 1), payload(40_000, 2)
    assert kept.keep(3, first, model_bytes) is first and kept.in_memory == len(first.data)
    spilled = [kept.keep(3, second, model_bytes), kept.keep(5, third, model_bytes)]
    assert all(isinstance(s, Spilled) for s in spilled) and kept.on_disk == len(second.data) + len(third.data)
    assert list(tmp_path.iterdir()) == []  # unnamed files: nothing is left behind
    for original, s in zip((second, third), spilled):
        back = kept.load(s)
        assert bytes(back.data) == bytes(original.data) and back.checksum == original.checksum
        assert torch.equal(codec.decode(back), codec.decode(original))
    kept.release(3)  # fragment 3's round closed: its memory and its file are free again
    assert kept.in_memory == 0 and kept.on_disk == len(third.data)
    assert kept.keep(3, second, model_bytes) is second  # under the budget again
    kept.release(5)
    assert kept.on_disk == 0
    kept.close()


def test_a_payload_damaged_on_disk_is_refused_by_its_checksum(tmp_path):
    kept = KeptPayloads(share=0.0, folder=tmp_path)
    s = kept.keep(0, payload(4096, 0), 4 * 4096)
    file = kept._files[0]
    file.seek(s.offset + 100)
    file.write(b"\xff\x00\xff")
    try:
        codec.decode(kept.load(s))
    except codec.CorruptPayload as e:
        assert "checksum" in str(e)
    else:
        raise AssertionError("a damaged payload was decoded")


def test_a_folder_that_cannot_hold_the_files_keeps_them_in_memory_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="diloco")
    kept = KeptPayloads(share=0.0, folder=tmp_path / "missing")
    p = payload(4096, 0)
    assert kept.keep(0, p, 4 * 4096) is p and kept.in_memory == len(p.data)
    assert "cannot keep the agreement test's payloads on disk" in caplog.text


def rounds_with_a_flip(kept_payloads):
    """One round of fragment F: three honest learners and one that flips its step, under the agreement test; (the
    step Θ took, each contributor as the round's event names it, the core)."""
    core, clock = core_in_memory(4, SPECS, linspace, sync_every=6, codec="int4", grace=0.0, grace_expect_steps=0.0,
                                 scale_partial_rounds=False, agreement_floor=0.25)
    events = []
    core.on_event = lambda kind, fields: events.append({"event": kind, **fields})
    if kept_payloads is not None:
        core.kept_payloads = kept_payloads
    steps = Steps(4096)
    pushes = {**{lid: steps.honest() for lid in "abc"}, "mallory": -1.9 * steps.honest()}
    before = core.fragments[F].outer_values().clone()
    for lid, delta in pushes.items():
        session = core.join(lid, SPECS)
        assert core.push(lid, session, 1, F, 0, 6, 600, codec.encode(delta, "int4")).accepted
    clock.now += 1.0
    core.poll()
    rounds = [e for e in events if e["event"] == "round"]
    seen = {c["learner"]: c for c in rounds[-1]["contributors"]} if rounds else {}
    return before - core.fragments[F].outer_values(), seen, core


def test_a_round_folded_in_anew_from_payloads_on_disk_merges_as_from_memory(tmp_path):
    in_memory, seen, _ = rounds_with_a_flip(None)
    assert seen["mallory"]["agreement"] == 0.0  # the round's sums were made anew from the payloads
    kept = KeptPayloads(share=0.0, folder=tmp_path)
    on_disk, seen, core = rounds_with_a_flip(kept)
    assert seen["mallory"]["agreement"] == 0.0
    assert torch.equal(in_memory, on_disk)
    assert kept.on_disk == 0 and kept._files[F].seek(0, 2) == 0  # emptied when the round closed


def test_a_payload_the_disk_damaged_drops_the_round_instead_of_merging_it(tmp_path, monkeypatch):
    kept = KeptPayloads(share=0.0, folder=tmp_path)
    real = kept.load

    def damaged(s):
        back = real(s)
        return codec.Encoded(back.codec, back.numel, bytes(len(back.data)), back.checksum)
    monkeypatch.setattr(kept, "load", damaged)
    moved, _, core = rounds_with_a_flip(kept)
    assert torch.count_nonzero(moved) == 0 and core.fragments[F].version == 0  # nothing published
