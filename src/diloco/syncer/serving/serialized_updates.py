"""Update chunks serialized once per payload and shared by every learner's stream that sends them.

A merged fragment's change goes to every learner. Serialized for each of them, its chunks were copied five times
per learner on the event loop (sliced, put in a message, sized, measured for the send window, serialized): at 128
learners of a 124M model, seconds of the loop's time for each round, during which no heartbeat was answered. Now a
chunk is its header (a few bytes of its own per stream: the push it answers differs) followed by its data field,
serialized once: protobuf parses concatenated serializations of a message as one message with the fields of both.
The two are joined only as gRPC takes the chunk (`Serialized.take`), not while it waits for its turn."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator

from diloco.algorithm import codec
from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import Serialized, blob_chunks


def data_fields(chunks) -> list[bytes]:
    """Each chunk's data field, serialized."""
    return [pb.Blob(data=bytes(chunk)).SerializeToString() for chunk in chunks]


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
        chunks = blob_chunks(fragment, version, payload, full, result_checksum, refused, seq, compression)
        data = [chunk for _, chunk in chunks]
        parts = self._shared(payload, compression, data)
        for (head, chunk), part in zip(chunks, parts if parts is not None else data_fields(data)):
            yield Serialized("Blob", head.SerializeToString(), len(chunk), payload.codec, shared=part)

    def _shared(self, payload: codec.Encoded, compression: str, chunks: list[memoryview]) -> list[bytes] | None:
        key = (id(payload), compression)
        with self._lock:
            entry = self._parts.get(key)
            if entry is not None and entry[0]() is payload:
                self._parts.move_to_end(key)
                return entry[1]
        size = sum(len(chunk) for chunk in chunks)
        if size > self.budget:
            return None
        parts = data_fields(chunks)
        with self._lock:
            self._drop(key)  # an entry of a payload gone whose id is reused
            while self._parts and self.held + size > self.budget:
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
