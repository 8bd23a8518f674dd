"""Δ computed and encoded where the model lives (`Learner(device_codec=True)`): the same payload bytes as the host
codec, from the base the syncer believes the learner holds. On a CPU model the device is the host; the CUDA half is
in tests/e2e/test_cuda.py."""

import pytest
import torch
from torch import nn

from diloco import Learner, for_mode
from diloco.algorithm import codec
from diloco.algorithm.codec import BLOCK, CODECS
from diloco.learner.staging import DeviceDelta, snapshot
from diloco.learner.transport import Arrival
from fakes import token_step
from recording import ExactRecording


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 300_001])
def test_encoding_into_a_tensor_makes_the_payload_bytes_whatever_the_chunk(name, numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 2, numel)
    expected = codec.encode(x, name)
    for step in (BLOCK, 3 * BLOCK, codec.CHUNK_BLOCKS * BLOCK, 1 << 23):
        out = torch.full((codec.encoded_size(numel, name),), 0xAB, dtype=torch.uint8)
        codec.encode_into(numel, lambda lo, hi: x[lo:hi], name, out, step)
        assert bytes(out.numpy()) == bytes(expected.data), step


def test_encoding_into_a_tensor_refuses_a_wrong_buffer_or_step():
    x = torch.randn(200)
    with pytest.raises(ValueError, match="200 values encoded as int4 need 136 uint8 bytes, got 135"):
        codec.encode_into(200, lambda lo, hi: x[lo:hi], "int4", torch.empty(135, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        codec.encode_into(200, lambda lo, hi: x[lo:hi], "int4", torch.empty(136, dtype=torch.int8))
    with pytest.raises(ValueError, match="whole number of 64-value blocks"):
        codec.encode_into(200, lambda lo, hi: x[lo:hi], "int4", torch.empty(136, dtype=torch.uint8), 100)
    assert codec.encode_from(0, lambda lo, hi: x[lo:hi], "int4").data == bytearray()


def test_a_device_delta_encodes_base_minus_the_snapshot():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(100, generator=g), torch.randn(7, 9, generator=g)]
    base = torch.randn(163, generator=g)
    taken = snapshot(tensors, to_host=False)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    for name in CODECS:
        assert DeviceDelta(base, taken).payload(name) == codec.encode(base - flat, name)
    assert torch.equal(DeviceDelta(base, taken).delta(), base - flat)
    with pytest.raises(ValueError, match="the base has 162 values, the snapshot 163"):
        DeviceDelta(base[:162], taken)


def trained(steps: int, **overrides):
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4, **overrides)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 32), nn.Linear(32, 50))
    transport = ExactRecording(cfg)
    learner = Learner(model, transport, "a", device_codec=True)
    transport.learner = learner
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        token_step(model, optimizer, 50)
        learner.step(64)
    return learner, transport


@pytest.mark.parametrize("keep_overlap", [True, False])
@pytest.mark.parametrize("name", ["int4", "int8"])
def test_a_device_codec_learner_pushes_the_host_codec_s_bytes_of_the_exact_delta(name, keep_overlap):
    learner, transport = trained(6, codec=name, keep_overlap=keep_overlap)
    assert len(transport.jobs) >= 2
    for job, exact in zip(transport.jobs, transport.exact):
        assert job.staged is None and isinstance(job.device, DeviceDelta)  # not staged in bf16 on the host
        assert job.payload(name) == codec.encode(exact, name)  # bitwise: the Δ itself, not a rounding of it
        assert job.device is None  # the payload is all a re-send needs
    assert learner._deltas.allocations == 0


def test_after_an_apply_the_next_delta_is_taken_from_the_merged_values():
    learner, transport = trained(4, codec="int4", keep_overlap=False)
    job = transport.jobs[0]
    slot = learner._slot[job.fragment]
    merged = slot.base + 0.01 * torch.randn(slot.base.numel())
    slot.ready = Arrival(job.fragment, slot.version + 1, merged, "", job.seq)
    learner._apply(job.fragment, learner._reads_local(slot))
    assert slot.device_base is merged and slot.base is merged  # on a CPU model the device is the host
    pushes = len(transport.jobs)
    while not any(j.fragment == job.fragment for j in transport.jobs[pushes:]):
        learner.step(64)
    nxt = next(j for j in transport.jobs[pushes:] if j.fragment == job.fragment)
    exact = transport.exact[transport.jobs.index(nxt)]
    assert nxt.base is merged and nxt.payload("int4") == codec.encode(exact, "int4")
