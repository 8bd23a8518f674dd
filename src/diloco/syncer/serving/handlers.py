"""The Syncer service's gRPC method handlers, made from the proto's service description, with a response serializer
that counts every message's bytes as gRPC sends it and sends a message serialized already (`Serialized`) as it is.

An update goes to every learner: its chunks are serialized for all of them together (`serialized_updates.py`), and
a message is never serialized a second time to learn its size."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import Serialized, payload_part

SERVICE = pb.DESCRIPTOR.services_by_name["Syncer"]
_HANDLER = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}

Count = Callable[[str, int, int, str | None], None]
"""(message type's name, bytes on the wire, bytes of encoded values it carries, their codec)."""


def serializer(count_sent: Count) -> Callable[[object], bytes]:
    """What gRPC calls to turn a reply into bytes: a `Serialized` as it is (its bytes taken from it), anything else
    by protobuf; each counted."""
    def serialize(message) -> bytes:
        if isinstance(message, Serialized):  # taken: gRPC holds the message itself until the stream's next one
            data = message.take()
            count_sent(message.name, len(data) + 5, message.payload, message.codec)
            return data
        data = message.SerializeToString()
        _, codec, payload = payload_part(message)
        count_sent(type(message).__name__, len(data) + 5, payload, codec)
        return data

    return serialize


def add_to_server(servicer, server: grpc.aio.Server, count_sent: Count) -> None:
    """Register `servicer`'s methods for every RPC of the Syncer service (as the generated
    `add_SyncerServicer_to_server` does, with `serializer` for every reply)."""
    handlers = {}
    for method in SERVICE.methods:
        make = _HANDLER[(method.client_streaming, method.server_streaming)]
        request = getattr(pb, method.input_type.name)
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=request.FromString,
                                     response_serializer=serializer(count_sent))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
