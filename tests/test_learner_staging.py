"""What a CPU learner holds for a push: Δ staged in bf16 in one reused buffer (int4 pushes), kept until the apply
where it reads the local values at the push back (keep-overlap), an fp32 snapshot for other codecs, values read
only at encoding when finishing; and payloads assembled into one buffer as their chunks arrive."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from diloco import Learner, for_mode
from diloco import codec
from diloco.learner.staging import DeltaArena, LiveValues, Snapshot, StagedDelta
from diloco.learner.transport import Arrival, Receiver
from diloco.syncer.downlink import tensor_checksum
from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import Assembler, blobs
from recording import Recording


def test_a_staged_delta_is_base_minus_values_rounded_to_bf16():
    torch.manual_seed(0)
    tensors = [torch.randn(3000), torch.randn(40, 50).to(torch.bfloat16)]
    base = torch.cat([t.float().reshape(-1) for t in tensors]) + 0.01 * torch.randn(5000)
    exact = base - torch.cat([t.float().reshape(-1) for t in tensors])
    arena = DeltaArena(8000)
    staged = StagedDelta(base, tensors, arena)
    assert staged.values.dtype == torch.bfloat16 and staged.values.numel() == 5000
    assert torch.equal(staged.values, exact.to(torch.bfloat16))
    other = StagedDelta(base, tensors, arena)  # the arena is lent: a buffer of its own
    assert other.values.data_ptr() != staged.values.data_ptr()
    lent_memory = staged.values.data_ptr()
    staged.release()
    assert staged.values is None
    again = StagedDelta(base[:100], [tensors[0][:100]], arena)  # given back: lent again, the same memory
    assert again.values.data_ptr() == lent_memory


def test_the_arena_lends_one_buffer_at_a_time_and_only_up_to_its_size():
    arena = DeltaArena(100)
    first, lent = arena.take(60)
    assert lent and first.numel() == 60
    second, lent2 = arena.take(10)
    assert not lent2 and second.data_ptr() != first.data_ptr()
    arena.give_back()
    third, lent3 = arena.take(100)
    assert lent3 and third.data_ptr() == first.data_ptr()
    arena.give_back()
    assert arena.take(101)[1] is False  # larger than the arena: never lent


def test_live_values_read_across_tensor_boundaries():
    tensors = [torch.arange(5.0), torch.arange(5.0, 12.0).view(7, 1), torch.tensor([12.0])]
    live = LiveValues(tensors)
    assert torch.equal(live.read(3, 9), torch.arange(3.0, 9.0))
    assert torch.equal(live.host(), torch.arange(13.0))


class ExactRecording(Recording):
    """Also records Δ computed exactly from the model at each push."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.exact, self.learner = [], None

    def push(self, job):
        tensors = self.learner._tensors(self.learner.layout[job.fragment])
        self.exact.append(job.base - torch.cat([t.detach().reshape(-1).float() for t in tensors]))
        super().push(job)


def trained_learner(steps: int = 6, **overrides) -> tuple[Learner, ExactRecording, nn.Module]:
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4, **overrides)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 32), nn.Linear(32, 50))
    transport = ExactRecording(cfg)
    learner = Learner(model, transport, "a")
    transport.learner = learner
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randint(0, 50, (64,))
        loss = nn.functional.cross_entropy(model(x), x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
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
    assert not learner._arena._lent


@pytest.mark.parametrize("overrides", [dict(keep_overlap=True, codec="fp32"), dict(keep_overlap=False, codec="fp32")])
def test_pushes_that_need_exact_local_values_keep_an_fp32_snapshot(overrides):
    _, transport, _ = trained_learner(**overrides)
    for job, exact in zip(transport.jobs, transport.exact):
        assert job.staged is None and isinstance(job.local, Snapshot)
        assert torch.equal(job.delta, exact)


def test_keep_overlap_reads_the_values_at_the_push_back_from_a_kept_staged_delta():
    learner, transport, model = trained_learner(keep_overlap=True, codec="int4")
    assert transport.jobs and not learner._arena._lent  # kept Δs have buffers of their own
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


def test_a_receiver_keeps_the_base_a_kept_push_was_computed_from():
    base = torch.randn(1000)
    change = codec.encode(0.01 * torch.randn(1000), "int8")
    for in_place in (True, False):
        receiver = Receiver()
        held = base.clone()
        receiver.reset([(0, 0, held)], in_place=in_place)
        new = held + codec.decode(change)
        pub = SimpleNamespace(fragment=0, version=1, seq=1, full=False, payload=change,
                              result_checksum=tensor_checksum(new))
        assert receiver.accept(pub)
        (arrival,) = receiver.drain(None)
        assert torch.equal(arrival.values, new)
        assert (arrival.values is held) == in_place and torch.equal(held, new if in_place else base)


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
    payload = codec.encode(torch.randn(2_000_000), "int8")
    chunks = list(blobs(0, 1, payload))
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
    first.total_bytes = 10  # claims 10 bytes, sends 2 MiB
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
