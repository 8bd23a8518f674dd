"""Optional zstd compression of int4/int8 payloads on the wire (`SyncConfig.wire_compression`).

Quantised outer gradients and changes are nearly uniform within their blocks, so zstd takes 5–17% off them
(`benchmarks/links/payload_entropy.py`); fp32 and bf16 payloads (joins, full values) are sent as they are. The CRC-32
of a payload stays that of its uncompressed bytes, checked after decompression. What arrives compressed is
untrusted: it must decompress to exactly the size its codec and value count give, or it is refused before more is
allocated (a small frame claiming gigabytes is a classic attack)."""

from __future__ import annotations

import weakref

import zstandard

from diloco.algorithm import codec
from diloco.config import WIRE_COMPRESSIONS as METHODS
LEVEL = 3
"""zstd's default level: 400–900 MB/s here on int4 payloads, within a percent of level 9's ratio."""

_packed: dict[int, tuple[weakref.ref, bytes]] = {}
"""Compressed bytes of payloads sent to several learners (a round's change), made once and gone with the payload;
by identity, since hashing a payload would read all of it."""


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown wire compression {method!r}; choose one of {', '.join(METHODS)}")
    return method


def pack(payload: codec.Encoded, method: str) -> tuple[bytes | memoryview, str]:
    """(the bytes to send, the compression they carry: "" for none). Only int4/int8 payloads are compressed, and
    only where that makes them smaller."""
    if check_method(method) == "none" or payload.codec not in ("int4", "int8"):
        return payload.data, ""
    key = id(payload)
    entry = _packed.get(key)
    if entry is not None and entry[0]() is payload:
        packed = entry[1]
    else:
        packed = zstandard.ZstdCompressor(level=LEVEL).compress(payload.data)
        _packed[key] = (weakref.ref(payload, lambda _, key=key: _packed.pop(key, None)), packed)
    if len(packed) >= len(payload.data):
        return payload.data, ""
    return packed, "zstd"


def unpack(data, method: str, codec_name: str, numel: int) -> bytes | bytearray:
    """The payload bytes `data` stands for, compressed with `method` ("" or "none": as they are). Raises
    codec.CorruptPayload unless they decompress to exactly the size `codec_name` gives `numel` values."""
    if method in ("", "none"):
        return data
    if method != "zstd":
        raise codec.CorruptPayload(f"unknown payload compression {method!r}: this syncer and learner speak "
                                   f"{', '.join(METHODS)}")
    expected = codec.encoded_size(numel, codec.check_codec(codec_name))
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise codec.CorruptPayload(f"zstd payload does not decompress to its {expected} bytes: {e}") from None
    if len(out) != expected:
        raise codec.CorruptPayload(f"zstd payload decompressed to {len(out)} bytes; {numel} {codec_name} values are "
                                   f"{expected}")
    return out
