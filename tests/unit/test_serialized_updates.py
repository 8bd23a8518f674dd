"""Update chunks serialized once and shared by every stream: each parses as the chunk `blobs` makes, the shared parts
live no longer than their payload and within their budget, and the handlers' serializer counts what it sends."""

import gc
import tracemalloc

import torch

from diloco.algorithm import codec
from diloco.syncer.serving.handlers import serializer
from diloco.syncer.serving.serialized_updates import SerializedUpdates
from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import CHUNK_BYTES, Serialized, blobs


def payload(numel: int, name: str = "int8") -> codec.Encoded:
    return codec.encode(torch.linspace(-1, 1, numel), name)


def fields(**kw):
    return dict(full=False, result_checksum=7, refused="", seq=3, **kw)


def test_each_serialized_chunk_parses_as_the_chunk_blobs_makes():
    updates = SerializedUpdates(budget=64 << 20)
    for numel, name, compression, refused in [(0, "int8", "none", ""), (1000, "int4", "zstd", ""),
                                              (3 * CHUNK_BYTES // 2 + 5, "int8", "none", "stale: resync"),
                                              (CHUNK_BYTES // 2, "fp32", "none", "")]:
        p = payload(numel, name)
        args = (4, 9, p, False, 7, refused, 3, compression)
        sent = list(updates.blobs(*args))
        expected = list(blobs(*args))
        assert len(sent) == len(expected) >= 1
        for message, blob in zip(sent, expected):
            assert pb.Blob.FromString(message.take()) == blob
            assert (message.name, message.payload, message.codec) == ("Blob", len(blob.data), p.codec)


def test_a_payload_is_serialized_once_for_every_stream_and_forgotten_with_it():
    updates = SerializedUpdates(budget=64 << 20)
    p = payload(CHUNK_BYTES + 10)
    first = [m.take() for m in updates.blobs(1, 2, p, **fields())]
    held = updates.held
    assert held >= len(p.data)
    again = [m.take() for m in updates.blobs(1, 2, p, full=False, result_checksum=7, refused="", seq=4)]
    assert updates.held == held  # nothing serialized anew
    assert [pb.Blob.FromString(d).seq for d in again] == [4, 4] and first != again
    del p
    gc.collect()
    assert updates.held == 0


def test_the_shared_parts_stay_within_their_budget():
    small, large = payload(1000), payload(20_000)
    updates = SerializedUpdates(budget=len(small.data) + 100)
    list(updates.blobs(1, 2, small, **fields()))
    kept = updates.held
    assert 0 < kept <= updates.budget
    sent = list(updates.blobs(1, 3, large, **fields()))  # larger than the budget: serialized for its stream alone
    assert updates.held == kept and pb.Blob.FromString(sent[0].take()).data == large.data
    other = payload(999)
    list(updates.blobs(2, 2, other, **fields()))  # room is made by dropping the least recently sent
    assert updates.held <= updates.budget and len(updates._parts) == 1


def test_the_handlers_serializer_sends_serialized_messages_as_they_are_and_counts_every_message():
    counted = []
    serialize = serializer(lambda *a: counted.append(a))
    data = b"\x08\x01"
    message = Serialized("Blob", data, payload=0, codec="int8")
    assert serialize(message) is data
    assert message.data == b""  # gRPC keeps a stream's last message until its next one: it holds no bytes now
    joined = Serialized("Blob", b"\x08\x02", payload=2, codec="int8", shared=b"\x22\x02ab")
    assert serialize(joined) == b"\x08\x02\x22\x02ab" and joined.data == joined.shared == b""
    reply = pb.HeartbeatReply(stop=True)
    assert serialize(reply) == reply.SerializeToString()
    blob = pb.JoinReply(blob=pb.Blob(codec="fp32", data=b"abcd"))
    serialize(blob)
    assert counted == [("Blob", 7, 0, "int8"), ("Blob", 11, 2, "int8"),
                       ("HeartbeatReply", reply.ByteSize() + 5, 0, None),
                       ("JoinReply", blob.ByteSize() + 5, 4, "fp32")]


def test_chunks_made_for_every_stream_share_their_data_until_sent():
    # a round's result goes to every learner at once: each stream's chunks wait for their turn to be written
    updates = SerializedUpdates(budget=64 << 20)
    p = payload(2 * CHUNK_BYTES)
    per_stream = len(list(updates.blobs(1, 2, p, **fields())))  # the shared parts, made once
    assert per_stream >= 2
    tracemalloc.start()
    try:
        streams = [list(updates.blobs(1, 2, p, **fields())) for _ in range(20)]
        waiting = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert sum(len(chunks) for chunks in streams) == 20 * per_stream
    assert waiting < CHUNK_BYTES  # a header each, not a joined chunk of 512 KiB each
    assert all(pb.Blob.FromString(c.take()).data == bytes(p.data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
               for chunks in streams for i, c in enumerate(chunks))
