"""Update chunks serialized once per payload and shared by every learner's stream that sends them.

A merged fragment's change goes to every learner. Serialized for each of them, its chunks were copied five times
per learner on the event loop (sliced, put in a message, sized, measured for the send window, serialized): at 128
learners of a 124M model, seconds of the loop's time for each round, during which no heartbeat was answered. Now a
chunk is its header (a few bytes of its own per stream: the push it answers differs) followed by its data field,
serialized once: protobuf parses concatenated serializations of a message as one message with the fields of both."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator

from diloco.algorithm import codec
from diloco.wire import diloco_pb2 as pb
from diloco.wire.compression import pack
from diloco.wire.messages import CHUNK_BYTES, Serialized


def data_fields(data) -> list[bytes]:
    """Each chunk's data field, serialized (at least one chunk, empty for an empty payload)."""
    view = memoryview(data)
    return [pb.Blob(data=bytes(view[offset : offset + CHUNK_BYTES])).SerializeToString()
            for offset in range(0, max(len(view), 1), CHUNK_BYTES)]


class SerializedUpdates:
    """The serialized data fields of the payloads sent lately, up to `budget` bytes (the least recently sent dropped
    first), each only as long as its payload lives; a payload larger than the budget is serialized per stream."""

    def __init__(self, budget: int = 0):
        self.budget = budget
        self.held = 0
        """Bytes of serialized data fields kept."""
        self._parts: OrderedDict[tuple[int, str], tuple[weakref.ref, list[bytes]]] = OrderedDict()
        self._lock = threading.RLock()  # a payload may be freed, its entry dropped, on another thread or in a GC here

    def blobs(self, fragment: int, version: int, payload: codec.Encoded, full: bool = True, result_checksum: int = 0,
              refused: str = "", seq: int = 0, compression: str = "none") -> Iterator[Serialized]:
        """`wire.messages.blobs`, serialized."""
        data, method = pack(payload, compression)
        parts = self._shared(payload, compression, data)
        if parts is None:
            parts = data_fields(data)
        for part, offset in zip(parts, range(0, max(len(data), 1), CHUNK_BYTES)):
            head = pb.Blob(fragment=fragment, version=version, codec=payload.codec, numel=payload.numel,
                           total_bytes=len(data), checksum=payload.checksum, offset=offset, full=full,
                           result_checksum=result_checksum, refused=refused, seq=seq, compression=method)
            yield Serialized("Blob", head.SerializeToString() + part, min(CHUNK_BYTES, len(data) - offset),
                             payload.codec)

    def _shared(self, payload: codec.Encoded, compression: str, data) -> list[bytes] | None:
        key = (id(payload), compression)
        with self._lock:
            entry = self._parts.get(key)
            if entry is not None and entry[0]() is payload:
                self._parts.move_to_end(key)
                return entry[1]
        if len(data) > self.budget:
            return None
        parts = data_fields(data)
        with self._lock:
            self._drop(key)  # an entry of a payload gone whose id is reused
            while self._parts and self.held + len(data) > self.budget:
                self._drop(next(iter(self._parts)))
            self._parts[key] = (weakref.ref(payload, lambda _, key=key: self._forget(key)), parts)
            self.held += sum(len(p) for p in parts)
        return parts

    def _forget(self, key: tuple[int, str]) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: tuple[int, str]) -> None:
        entry = self._parts.pop(key, None)
        if entry is not None:
            self.held -= sum(len(p) for p in entry[1])
