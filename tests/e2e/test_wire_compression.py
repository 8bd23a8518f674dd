"""zstd on the wire (`--wire-compression zstd`): int4/int8 payloads shrink, arrive as they were sent, and what
does not decompress to exactly its codec's size is refused before it is allocated."""

import pytest
import torch
import zstandard

from diloco import for_mode

from diloco.algorithm import codec
from diloco.wire import compression
from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import Assembler, blobs, push_chunks
from syncers import train_two


def outer_gradient(n=1 << 16, seed=0):
    """Heavy-tailed like real outer gradients, whose quantised values then are not uniform."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) ** 3 * 1e-3


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_quantised_payloads_shrink_and_come_back_exactly(name):
    payload = codec.encode(outer_gradient(), name)
    data, method = compression.pack(payload, "zstd")
    assert method == "zstd" and len(data) < len(payload.data)
    assert bytes(compression.unpack(data, method, name, payload.numel)) == bytes(payload.data)
    assert compression.pack(payload, "zstd")[0] is data  # made once for every learner it goes to


def test_fp32_and_incompressible_payloads_go_as_they_are():
    full = codec.encode(torch.randn(1000), "fp32")
    assert compression.pack(full, "zstd") == (full.data, "")
    size = codec.encoded_size(4000, "int8")
    noise = codec.Encoded("int8", 4000, torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes(), 0)
    data, method = compression.pack(noise, "zstd")
    assert method == "" and data is noise.data
    assert compression.pack(codec.encode(outer_gradient(), "int4"), "none")[1] == ""


def test_a_compressed_payload_of_the_wrong_size_is_refused_before_it_is_made():
    payload = codec.encode(outer_gradient(), "int4")
    data, _ = compression.pack(payload, "zstd")
    with pytest.raises(codec.CorruptPayload, match="does not decompress|decompressed to"):
        compression.unpack(data, "zstd", "int4", payload.numel // 2)  # claims fewer values than it holds
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 26))  # 64 MB of zeros in a few kB
    with pytest.raises(codec.CorruptPayload):
        compression.unpack(bomb, "zstd", "int4", 1000)
    with pytest.raises(codec.CorruptPayload, match="does not decompress"):
        compression.unpack(b"not zstd at all", "zstd", "int4", 1000)
    with pytest.raises(codec.CorruptPayload, match="unknown payload compression 'lz4'"):
        compression.unpack(data, "lz4", "int4", payload.numel)


def test_blobs_and_pushes_carry_compressed_payloads_that_assemble_to_the_original():
    payload = codec.encode(outer_gradient(1 << 20), "int8")
    sent = list(blobs(3, 7, payload, full=False, seq=2, compression="zstd"))
    assert all(b.compression == "zstd" for b in sent) and sum(len(b.data) for b in sent) < len(payload.data)
    assembler = Assembler()
    done = [a for b in sent if (a := assembler.add(b)) is not None]
    assert len(done) == 1 and bytes(done[0].payload.data) == bytes(payload.data)
    assert torch.equal(codec.decode(done[0].payload), codec.decode(payload))
    chunks = list(push_chunks(pb.PushHeader(learner_id="a"), payload, "zstd"))
    header = chunks[0].header
    assert header.compression == "zstd" and header.total_bytes == sum(len(c.data) for c in chunks[1:])
    assert header.total_bytes < len(payload.data) and header.checksum == payload.checksum


def test_two_learners_train_over_zstd_both_ways(monkeypatch):
    """A real syncer and two learners on loopback with --wire-compression zstd: pushes and answers go compressed,
    and every answer a learner applies matches the syncer's checksum of what it must then hold."""
    sent = []
    original = compression.pack

    def counting(payload, method):
        out = original(payload, method)
        sent.append((payload.codec, out[1]))
        return out

    monkeypatch.setattr("diloco.wire.messages.pack", counting)  # the learners' pushes and the syncer's answers
    done, status = train_two(for_mode("decoupled", 2, fragments=2, sync_every=4, wire_compression="zstd"), steps=30)
    assert len(done) == 2 and all(learner.applied >= 1 for learner in done.values())
    assert status["rounds"] >= 2
    assert ("int4", "zstd") in sent and ("int8", "zstd") in sent  # pushes up, changes down
    assert ("fp32", "") in sent  # the joins' full values go as they are
