"""Helpers between the algorithm's types and the protobuf messages: specs, chunked payloads, byte counts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from diloco.algorithm import codec
from diloco.algorithm.fragments import KINDS, TensorSpec
from diloco.wire import diloco_pb2 as pb
from diloco.wire.compression import pack, unpack

CHUNK_BYTES = 512 << 10
"""Payload bytes per gRPC message. Each update stream holds its chunk (its own header, then the shared data field)
while gRPC writes it, and each push a few copies while it is read: per learner, memory of this size. With 2 MiB
chunks a 124M model's syncer peaked at 2.96× the model with 64 learners and 3.53× with 128; with 512 KiB at 2.43× and
2.61×, its CPU and a model's transfer time unchanged (benchmarks/LOG.md, "Update chunks of 512 KiB"). Either end
takes chunks of any size up to MAX_MESSAGE_BYTES."""
REPORT_BYTES = 2 << 20
"""A learner reports what its update stream received early (a heartbeat before its time) once this much more came
in: the syncer's send window moves on, at a heartbeat per 2 MiB however small the chunks."""
MAX_MESSAGE_BYTES = 16 << 20  # one chunk plus headroom; raised from gRPC's 4 MiB default on both ends
KEEPALIVE_MS = 10_000
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]
SERVER_OPTIONS = GRPC_OPTIONS + [("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                                 ("grpc.so_reuseport", 0)]
"""No SO_REUSEPORT (gRPC's default): a second syncer on a busy port fails to bind instead of sharing the learners."""


RPC_OF = {"JoinRequest": "join", "JoinReply": "join", "InitChunk": "init", "InitReply": "init",
          "PushChunk": "push", "PushReply": "push", "SubscribeRequest": "downlink", "Blob": "downlink",
          "HeartbeatRequest": "heartbeat", "HeartbeatReply": "heartbeat", "LeaveRequest": "leave",
          "LeaveReply": "leave"}
"""The call each message belongs to, for counting wire bytes by call."""


def payload_part(message) -> tuple[str, str | None, int]:
    """(call, codec, bytes of encoded values) a message carries; everything else in it is framing. The codec of
    a push's data chunk is in its stream's header (None here)."""
    blob = None
    if isinstance(message, pb.Blob):
        blob = message
    elif isinstance(message, (pb.JoinReply, pb.InitChunk)) and message.HasField("blob"):
        blob = message.blob
    rpc = RPC_OF.get(type(message).__name__, "other")
    if blob is not None:
        return rpc, blob.codec, len(blob.data)
    if isinstance(message, pb.PushChunk) and message.HasField("data"):
        return rpc, None, len(message.data)
    return rpc, None, 0


@dataclass(slots=True)
class Serialized:
    """A message serialized already, which the syncer's gRPC handlers send as it is (syncer/serving/handlers.py):
    `name` its type's name, `payload` the bytes of encoded values it carries, in `codec` (counted apart from its
    framing). Its bytes are `data` followed by `shared`, a part other messages send too (an update chunk's data
    field, the same for every learner), joined only when gRPC takes them (`take`): a round's result goes to every
    learner at once, and chunks joined as they were made, each waiting for its turn to be written, were a chunk per
    learner. Taken once: gRPC's server keeps a stream's last message while the stream waits for its next one."""

    name: str
    data: bytes
    payload: int = 0
    codec: str | None = None
    shared: bytes = b""

    def take(self) -> bytes:
        """The bytes, which this message no longer holds."""
        data = self.data + self.shared if self.shared else self.data
        self.data = self.shared = b""
        return data


def wire_size(message) -> int:
    """Bytes a message occupies on a gRPC stream: serialized size plus the 5-byte length prefix."""
    return message.ByteSize() + 5


def specs_to_proto(specs: list[TensorSpec]) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, embedding=s.embedding, kind=s.kind,
                          alias_of=s.alias_of) for s in specs]


def specs_from_proto(specs) -> list[TensorSpec]:
    """Specs from the wire; an unknown kind is refused here, before anything is built from it."""
    out = []
    for s in specs:
        kind = s.kind or "param"
        if kind not in KINDS:
            raise ValueError(f"tensor {s.name!r} has unknown kind {s.kind!r}")
        out.append(TensorSpec(s.name, tuple(int(d) for d in s.shape), s.dtype, s.embedding, kind, s.alias_of))
    return out


def blob_chunks(fragment: int, version: int, payload: codec.Encoded, full: bool = True, result_checksum: int = 0,
                refused: str = "", seq: int = 0, compression: str = "none") -> list[tuple[pb.Blob, memoryview]]:
    """A payload's chunks as (the Blob without its data, a view of its data): at least one, empty for an empty
    payload. `compression`: see `wire.compression.pack`."""
    data, method = pack(payload, compression)
    view = memoryview(data)
    return [(pb.Blob(fragment=fragment, version=version, codec=payload.codec, numel=payload.numel,
                     total_bytes=len(view), checksum=payload.checksum, offset=offset, full=full,
                     result_checksum=result_checksum, refused=refused, seq=seq, compression=method),
             view[offset : offset + CHUNK_BYTES])
            for offset in range(0, max(len(view), 1), CHUNK_BYTES)]


def blobs(fragment: int, version: int, payload: codec.Encoded, full: bool = True, result_checksum: int = 0,
          refused: str = "", seq: int = 0, compression: str = "none") -> Iterator[pb.Blob]:
    """A payload as a sequence of Blob chunks; the first carries all metadata, later ones repeat it (tiny). The
    payload's data may be a memoryview (`codec.view_fp32`): each chunk is copied as it is sent."""
    for blob, data in blob_chunks(fragment, version, payload, full, result_checksum, refused, seq, compression):
        blob.data = bytes(data)
        yield blob


@dataclass
class Assembled:
    fragment: int
    version: int
    payload: codec.Encoded
    full: bool
    result_checksum: int
    refused: str
    seq: int = 0


class Assembler:
    """Collects Blob chunks into payloads; refuses out-of-order, oversized or inconsistent chunks. Each payload is
    written into one buffer as its chunks arrive, so assembling never holds it twice."""

    def __init__(self, max_payload_bytes: int = 1 << 34):
        self.max_payload_bytes = max_payload_bytes
        self._open: dict[tuple[int, int], tuple[pb.Blob, bytearray]] = {}
        self._size: dict[tuple[int, int], int] = {}

    def add(self, blob: pb.Blob) -> Assembled | None:
        key = (blob.fragment, blob.version)
        if blob.total_bytes > self.max_payload_bytes:
            raise codec.CorruptPayload(f"payload of {blob.total_bytes} bytes exceeds the {self.max_payload_bytes}-byte limit")
        expected = self._size.get(key, 0)
        if blob.offset != expected:
            self._drop(key)
            raise codec.CorruptPayload(f"chunk at offset {blob.offset} of fragment {blob.fragment}, expected {expected}")
        if expected == 0:
            first = pb.Blob()
            first.CopyFrom(blob)
            first.ClearField("data")
            self._open[key] = (first, bytearray(blob.total_bytes))
        first, data = self._open[key]
        end = expected + len(blob.data)
        if blob.total_bytes != first.total_bytes or end > len(data):
            self._drop(key)
            raise codec.CorruptPayload(f"fragment {blob.fragment}: chunks disagree on the payload's size or overrun it "
                                       f"({end} of {len(data)} bytes)")
        data[expected:end] = blob.data
        self._size[key] = end
        if end < len(data):
            return None
        self._drop(key)
        data = unpack(data, first.compression, first.codec, first.numel)
        return Assembled(first.fragment, first.version, codec.Encoded(first.codec, first.numel, data, first.checksum),
                         first.full, first.result_checksum, first.refused, first.seq)

    def _drop(self, key: tuple[int, int]) -> None:
        self._open.pop(key, None)
        self._size.pop(key, None)


def push_chunks(header: pb.PushHeader, payload: codec.Encoded, compression: str = "none") -> Iterator[pb.PushChunk]:
    data, header.compression = pack(payload, compression)
    header.codec, header.numel = payload.codec, payload.numel
    header.total_bytes, header.checksum = len(data), payload.checksum
    yield pb.PushChunk(header=header)
    data = memoryview(data)  # each chunk is copied as it is sent, the payload never twice
    for offset in range(0, len(data), CHUNK_BYTES):
        yield pb.PushChunk(data=bytes(data[offset : offset + CHUNK_BYTES]))
