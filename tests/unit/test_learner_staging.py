"""What a CPU learner holds for a push: Δ staged in bf16 in one reused buffer (int4 pushes), kept until the apply
where it reads the local values at the push back (keep-overlap), an fp32 snapshot for other codecs, values read
only at encoding when finishing; and payloads assembled into one buffer as their chunks arrive."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from diloco import Learner, for_mode
from diloco.algorithm import codec
from diloco.learner.staging import BufferRing, LiveValues, Snapshot, StagedDelta
from diloco.learner.transport import Arrival, Receiver
from diloco.syncer.downlink import tensor_checksum
from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import Assembler, blobs
from recording import ExactRecording


def test_a_staged_delta_is_base_minus_values_rounded_to_bf16():
    torch.manual_seed(0)
    tensors = [torch.randn(3000), torch.randn(40, 50).to(torch.bfloat16)]
    base = torch.cat([t.float().reshape(-1) for t in tensors]) + 0.01 * torch.randn(5000)
    exact = base - torch.cat([t.float().reshape(-1) for t in tensors])
    ring = BufferRing(20000)
    staged = StagedDelta(base, tensors, ring)
    assert staged.values.dtype == torch.bfloat16 and staged.values.numel() == 5000
    assert torch.equal(staged.values, exact.to(torch.bfloat16))
    other = StagedDelta(base, tensors, ring)  # both in flight: spans that do not overlap
    assert abs(other.values.data_ptr() - staged.values.data_ptr()) >= 5000 * 2
    staged.release()
    other.release()
    assert staged.values is None and not ring.lent
    again = StagedDelta(base[:100], [tensors[0][:100]], ring)  # given back: cut from the same ring again
    assert again.values.data_ptr() == ring.buffer.data_ptr()


def test_a_kept_delta_outlives_its_encoding_and_is_given_back_at_its_apply():
    ring = BufferRing(1000)
    kept = StagedDelta(torch.ones(100), [torch.zeros(100)], ring, kept=True)
    kept.release()  # encoded: the apply still reads it
    assert torch.equal(kept.values, torch.ones(100, dtype=torch.bfloat16)) and len(ring.lent) == 1
    kept.drop()
    assert kept.values is None and not ring.lent


def test_live_values_read_across_tensor_boundaries():
    tensors = [torch.arange(5.0), torch.arange(5.0, 12.0).view(7, 1), torch.tensor([12.0])]
    live = LiveValues(tensors)
    assert torch.equal(live.read(3, 9), torch.arange(3.0, 9.0))
    assert torch.equal(live.host(), torch.arange(13.0))


def joined_learner(transport_type, **overrides):
    """(learner, transport, model, optimizer): a small model with an embedding, P = 2, H = 4, through `transport_type`."""
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4, **overrides)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 32), nn.Linear(32, 50))
    transport = transport_type(cfg)
    learner = Learner(model, transport, "a")
    transport.learner = learner
    return learner, transport, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def inner_step(model, optimizer) -> None:
    x = torch.randint(0, 50, (64,))
    loss = nn.functional.cross_entropy(model(x), x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def trained_learner(steps: int = 6, **overrides) -> tuple[Learner, ExactRecording, nn.Module]:
    learner, transport, model, optimizer = joined_learner(ExactRecording, **overrides)
    for _ in range(steps):
        inner_step(model, optimizer)
        learner.step(64)
    return learner, transport, model


def test_int4_pushes_stage_delta_in_bf16_and_encode_within_int4_error():
    learner, transport, _ = trained_learner(keep_overlap=False, codec="int4")
    assert transport.jobs and all(job.staged is not None and job.local is None for job in transport.jobs)
    for job, exact in zip(transport.jobs, transport.exact):
        assert torch.allclose(job.delta, exact, rtol=2**-8, atol=1e-9)
        decoded = codec.decode(job.payload("int4"))
        blocks = torch.nn.functional.pad(exact, (0, -exact.numel() % codec.BLOCK)).view(-1, codec.BLOCK)
        half_step = (blocks.abs().amax(dim=1, keepdim=True) / 14).expand_as(blocks).reshape(-1)[:exact.numel()]
        assert ((decoded - exact).abs() <= half_step * (1 + 2**-7) + exact.abs() * 2**-8 + 1e-9).all()
        assert job.staged is None  # released once encoded
    assert not learner._deltas.lent  # every span given back once encoded


@pytest.mark.parametrize("overrides", [dict(keep_overlap=True, codec="fp32"), dict(keep_overlap=False, codec="fp32")])
def test_pushes_that_need_exact_local_values_keep_an_fp32_snapshot(overrides):
    _, transport, _ = trained_learner(**overrides)
    for job, exact in zip(transport.jobs, transport.exact):
        assert job.staged is None and isinstance(job.local, Snapshot)
        assert torch.equal(job.delta, exact)


def test_keep_overlap_reads_the_values_at_the_push_back_from_a_kept_staged_delta():
    learner, transport, model = trained_learner(keep_overlap=True, codec="int4")
    assert transport.jobs and learner._deltas.lent  # kept Δs hold their spans until their apply
    for job, exact in zip(transport.jobs, transport.exact):
        slot = learner._slot[job.fragment]
        staged, base = job.staged, job.base
        assert staged is not None and staged.kept and slot.pushed[0] is staged
        job.payload("int4")  # encoded: the sender is done with it, the learner is not
        assert job.staged is None and staged.values is not None
        tensors = learner._tensors(slot.fragment)
        now = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        at_push = base - exact
        merged = base + 0.01 * torch.randn(base.numel())
        slot.ready = Arrival(job.fragment, slot.version + 1, merged, "", job.seq)
        learner._apply(job.fragment, learner._reads_local(slot))
        after = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        # θ ← Θ + (θ − θ at push), with θ at push read back as base − Δ (Δ rounded to bf16)
        assert torch.allclose(after, merged + (now - at_push), rtol=0, atol=float(exact.abs().max()) * 2**-8 + 1e-6)
        assert slot.pushed is None and slot.base is merged


def change_to(held: torch.Tensor, target: torch.Tensor, fragment: int, version: int, seq: int, down: str = "int8"):
    """A publication of the change from `held` towards `target`, and the values held after it."""
    change = codec.encode(target - held, down)
    after = held.clone()
    codec.decode_add(change, after)  # what the syncer publishes: P + decode(change), in fp32
    return SimpleNamespace(fragment=fragment, version=version, seq=seq, full=False, payload=change,
                           result_checksum=tensor_checksum(after)), after


def full_values(values: torch.Tensor, fragment: int, version: int, seq: int):
    return SimpleNamespace(fragment=fragment, version=version, seq=seq, full=True, payload=codec.encode(values, "fp32"),
                           result_checksum=tensor_checksum(values))


@pytest.mark.parametrize("keep_overlap", [True, False])
def test_a_receiver_decodes_the_answers_to_a_push_into_the_values_it_holds(keep_overlap):
    torch.manual_seed(0)
    held = torch.randn(1000)
    receiver = Receiver()
    receiver.reset([(0, 0, held)], keep_overlap=keep_overlap)
    memory = held.data_ptr()
    receiver.pushed(0, 1, held)
    link, after_link = change_to(held, held + 0.01 * torch.randn(1000), 0, 1, 0)
    answer, after = change_to(after_link, after_link + 0.01 * torch.randn(1000), 0, 2, 1)
    assert receiver.accept(link) and receiver.accept(answer)
    arrivals = receiver.drain(None)
    assert [a.seq for a in arrivals] == [0, 1]
    # no copy of the fragment: both changes went into the tensor the learner holds as its base
    assert all(a.values is held for a in arrivals) and receiver.held[0] is held and held.data_ptr() == memory
    assert torch.equal(held, after)
    assert receiver.settle(0, 1) == [link.payload, answer.payload]  # what the apply needs of the base at the push
    assert receiver.settle(0, 1) == []  # forgotten once settled


def test_a_receiver_keeps_a_base_with_no_push_in_flight_under_keep_overlap():
    torch.manual_seed(0)
    base = torch.randn(1000)
    for keep_overlap in (True, False):
        held = base.clone()
        receiver = Receiver()
        receiver.reset([(0, 0, held)], keep_overlap=keep_overlap)
        pub, new = change_to(held, held + 0.01 * torch.randn(1000), 0, 1, 0)
        assert receiver.accept(pub)
        (arrival,) = receiver.drain(None)
        assert torch.equal(arrival.values, new)
        # keep-overlap: the base of the next push stays as it was (the learner applies none of this); overwrite: as
        # before, in place
        assert (arrival.values is held) != keep_overlap and torch.equal(held, base if keep_overlap else new)


def test_changes_after_the_answer_do_not_touch_the_answer_under_keep_overlap():
    torch.manual_seed(0)
    held = torch.randn(1000)
    receiver = Receiver()
    receiver.reset([(0, 0, held)], keep_overlap=True)
    receiver.pushed(0, 1, held)
    answer, merged = change_to(held, held + 0.01 * torch.randn(1000), 0, 1, 1)
    later, _ = change_to(merged, merged + 0.01 * torch.randn(1000), 0, 2, 0)
    assert receiver.accept(answer) and receiver.accept(later)
    first, second = receiver.drain(None)
    assert first.values is held and torch.equal(held, merged) and second.values is not held
    assert receiver.settle(0, 1) == [answer.payload]


class ReceivingTransport(ExactRecording):
    """Keeps push jobs, and delivers to the learner the publications a test hands its Receiver."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.receiver = Receiver()

    def join(self, learner_id, specs, initial):
        info = super().join(learner_id, specs, initial)
        self.receiver.reset(info.fragments, keep_overlap=self.cfg.keep_overlap)
        return info

    def arrivals(self, timeout=None):
        return self.receiver.drain(None)


def pushed_learner(codec_name: str):
    """A learner (keep-overlap) that pushed fragment 0 and took more steps since; (learner, transport, job, base at
    the push, θ at the push, θ now), flat fp32 copies."""
    learner, transport, model, optimizer = joined_learner(ReceivingTransport, keep_overlap=True, codec=codec_name,
                                                          overlap=3)

    def flat():
        return torch.cat([t.detach().reshape(-1).float() for t in learner._tensors(learner.layout[0])])

    job = base = at_push = None
    while True:
        inner_step(model, optimizer)
        if job is not None and learner.step_count == learner._slot[0].pushed_at + 2:
            break  # two steps past the push of fragment 0, its answer not yet applied (τ = 3)
        before = flat()
        learner.step(64)
        if job is None and transport.jobs and transport.jobs[-1].fragment == 0:
            job, base, at_push = transport.jobs[-1], learner._slot[0].base.clone(), before
    job.payload(codec_name)  # the sender encodes it before the syncer can answer
    return learner, transport, job, base, at_push, flat()


ANSWERS = {
    "a change": ["change"],
    "a chain of two changes": ["change", "change"],
    "a full answer after a change": ["change", "full"],
    "a change after full values": ["full", "change"],
}


@pytest.mark.parametrize("apply", ["in place", "flat"])
@pytest.mark.parametrize("kinds", list(ANSWERS.values()), ids=list(ANSWERS))
def test_keep_overlap_applies_answers_decoded_into_the_base_as_from_the_base_at_the_push(kinds, apply):
    learner, transport, job, base, at_push, now = pushed_learner("int4")
    slot, receiver = learner._slot[0], transport.receiver
    staged = slot.pushed[0]
    assert isinstance(staged, StagedDelta) and job.seq == slot.pushed_seq
    memory = slot.base.data_ptr()
    held = base.clone()  # the values the syncer believes this learner holds, computed apart from the learner's
    torch.manual_seed(1)
    for i, kind in enumerate(kinds):
        seq = job.seq if i == len(kinds) - 1 else 0
        if kind == "change":
            pub, held = change_to(held, held + 0.01 * torch.randn(held.numel()), 0, slot.version + i + 1, seq)
        else:
            held = held + 0.01 * torch.randn(held.numel())
            pub = full_values(held, 0, slot.version + i + 1, seq)
        assert receiver.accept(pub)
        if kind == "change" and "full" not in kinds[:i]:  # decoded into the base itself: no copy of the fragment
            assert receiver.held[0] is slot.base and slot.base.data_ptr() == memory
    learner._collect(block=False)
    assert slot.ready is not None and slot.ready.seq == job.seq
    # the apply as before: θ ← Θ + (θ − base at push) + Δ, from a base at the push kept whole
    expected = (now - base + staged.values.float()) + held
    fragment = learner.layout[0]
    if apply == "in place":
        learner._apply(0, learner._reads_local(slot))
        after = torch.cat([t.detach().reshape(-1).float() for t in learner._tensors(fragment)])
    else:  # what an island's leader broadcasts
        after = learner._merged_values(slot, learner._local(fragment))
    # the same up to fp32 rounding; a change left out or counted twice would be off by ~0.01
    scale = float(torch.stack([now.abs().max(), base.abs().max(), held.abs().max()]).max())
    assert (after - expected).abs().max() <= 8 * 2**-24 * scale
    bf16 = float((base - at_push).abs().max()) * 2**-8  # θ at push read back as base − Δ, Δ rounded to bf16
    assert torch.allclose(held + (now - at_push), after, rtol=0, atol=bf16 + 1e-6)
    assert slot.pushed is None and slot.pushed_at is None and torch.equal(slot.base, held)
    assert receiver.settle(0, job.seq) == []


def test_keep_overlap_from_an_fp32_snapshot_applies_answers_decoded_into_the_base_exactly():
    learner, transport, job, base, at_push, now = pushed_learner("fp32")
    slot = learner._slot[0]
    assert isinstance(slot.pushed[0], Snapshot)
    link, after_link = change_to(base, base + 0.01 * torch.randn(base.numel()), 0, slot.version + 1, 0)
    answer, merged = change_to(after_link, after_link + 0.01 * torch.randn(base.numel()), 0, slot.version + 2, job.seq)
    assert transport.receiver.accept(link) and transport.receiver.accept(answer)
    assert transport.receiver.held[0] is slot.base
    learner._collect(block=False)
    learner._apply(0, learner._reads_local(slot))
    after = torch.cat([t.detach().reshape(-1).float() for t in learner._tensors(learner.layout[0])])
    assert torch.equal(after, (now - at_push) + merged)  # θ ← Θ + (θ − θ at push), in that order, as before


def test_finish_reads_each_fragment_only_when_its_payload_is_made():
    learner, transport, model = trained_learner(steps=1, keep_overlap=True, codec="int4")
    pushed = len(transport.jobs)
    learner.finish(timeout=5)
    flushed = transport.jobs[pushed:]
    assert flushed and transport.closed
    for job, exact in zip(flushed, transport.exact[pushed:]):
        assert isinstance(job.local, LiveValues)
        assert job.payload("int4").data == codec.encode(exact, "int4").data


def test_chunks_are_assembled_into_one_buffer_in_order():
    values = torch.randn(5_000_000)
    payload = codec.encode(values, "int8")
    chunks = list(blobs(3, 7, payload, seq=2))
    assert len(chunks) > 2
    assembler = Assembler(max_payload_bytes=len(payload.data))
    done = [assembler.add(c) for c in chunks]
    assert all(d is None for d in done[:-1])
    assert done[-1].payload.data == payload.data and done[-1].seq == 2
    assert torch.equal(codec.decode(done[-1].payload), codec.decode(payload))


def test_the_assembler_refuses_disorder_disagreement_overrun_and_size():
    payload = codec.encode(torch.randn(600_000), "int8")  # a little over one chunk
    chunks = list(blobs(0, 1, payload))
    assert len(chunks) == 2
    with pytest.raises(codec.CorruptPayload, match="expected 0"):
        Assembler().add(chunks[1])
    assembler = Assembler()
    assembler.add(chunks[0])
    lying = pb.Blob()
    lying.CopyFrom(chunks[1])
    lying.total_bytes += 1
    with pytest.raises(codec.CorruptPayload, match="disagree"):
        assembler.add(lying)
    first = pb.Blob()
    first.CopyFrom(chunks[0])
    first.total_bytes = 10  # claims 10 bytes, sends a chunk
    with pytest.raises(codec.CorruptPayload, match="overrun"):
        Assembler().add(first)
    with pytest.raises(codec.CorruptPayload, match="limit"):
        Assembler(max_payload_bytes=len(payload.data) - 1).add(chunks[0])


def test_the_transports_worker_threads_run_at_a_lower_priority_than_training():
    import os
    import threading

    from diloco.learner.grpc_transport import BACKGROUND_NICE, background

    seen = {}

    def loop():
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=background(loop))
    thread.start()
    thread.join()
    assert seen["nice"] == min(19, before + BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the caller's is unchanged
