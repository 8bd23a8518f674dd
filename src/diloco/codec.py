"""Outer-gradient codecs (DESIGN §3.6): fp32, bf16, int8 and int4 with one fp32 scale per block of values.

A payload is the codec's bytes for a flat fp32 vector plus a CRC-32 of those bytes; `decode` verifies the
checksum before it reads anything, so a corrupted payload is refused instead of merged.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

CODECS = ("fp32", "bf16", "int8", "int4")
BLOCK = 64  # values per scale: 0.5 extra bits per value for int4, a fine trade for outlier-robust scales
_LEVELS = {"int8": 127, "int4": 7}  # symmetric: int4 uses -7..7 so that 0 is exact and the range is balanced


class CorruptPayload(ValueError):
    """A payload whose bytes do not match its checksum or its declared size."""


@dataclass(frozen=True)
class Encoded:
    codec: str
    numel: int
    data: bytes
    checksum: int


def checksum(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return codec


def encoded_size(numel: int, codec: str) -> int:
    """Bytes of a payload of `numel` values: what the receiver expects before it decodes."""
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    blocks = -(-numel // BLOCK)
    values = blocks * BLOCK
    return 4 * blocks + (values if codec == "int8" else values // 2)


def encode(x: torch.Tensor, codec: str) -> Encoded:
    """Encode a 1-D float tensor."""
    check_codec(codec)
    x = x.detach().reshape(-1).to("cpu", torch.float32)
    numel = x.numel()
    if codec == "fp32":
        data = x.numpy().tobytes()
    elif codec == "bf16":
        data = x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    else:
        levels = _LEVELS[codec]
        blocks = -(-numel // BLOCK)
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
        padded[:numel] = x
        padded = padded.view(blocks, BLOCK)
        scale = padded.abs().amax(dim=1) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(padded / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
        if codec == "int8":
            body = q.numpy().tobytes()
        else:
            nibbles = (q + 8).to(torch.uint8).view(-1)  # 1..15, two per byte: even index low, odd index high
            body = (nibbles[0::2] | (nibbles[1::2] << 4)).numpy().tobytes()
        data = scale.numpy().tobytes() + body
    return Encoded(codec, numel, data, checksum(data))


def decode(payload: Encoded) -> torch.Tensor:
    """The flat fp32 tensor a payload stands for; raises CorruptPayload if it was damaged."""
    check_codec(payload.codec)
    expected = encoded_size(payload.numel, payload.codec)
    if len(payload.data) != expected:
        raise CorruptPayload(f"{payload.codec} payload of {payload.numel} values must be {expected} bytes, got {len(payload.data)}")
    if checksum(payload.data) != payload.checksum:
        raise CorruptPayload("payload checksum mismatch: the bytes were damaged in transit")
    buf = bytearray(payload.data)  # writable, so torch does not warn about read-only memory
    if payload.codec == "fp32":
        return torch.frombuffer(buf, dtype=torch.float32).clone()
    if payload.codec == "bf16":
        return torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16).to(torch.float32)
    blocks = -(-payload.numel // BLOCK)
    scale = torch.frombuffer(buf, dtype=torch.float32, count=blocks)
    body = np.frombuffer(payload.data, dtype=np.uint8, offset=4 * blocks)
    if payload.codec == "int8":
        q = torch.from_numpy(body.view(np.int8).astype(np.float32))
    else:
        packed = torch.from_numpy(body.copy())
        q = torch.empty(packed.numel() * 2, dtype=torch.float32)
        q[0::2] = (packed & 0x0F).to(torch.float32) - 8
        q[1::2] = (packed >> 4).to(torch.float32) - 8
    return (q.view(blocks, BLOCK) * scale[:, None]).reshape(-1)[: payload.numel].clone()


class ErrorFeedback:
    """Carries each fragment's quantisation error into its next outer gradient (optional, learner side)."""

    def __init__(self) -> None:
        self._residual: dict[int, torch.Tensor] = {}

    def encode(self, fragment: int, delta: torch.Tensor, codec: str) -> Encoded:
        corrected = delta + self._residual[fragment] if fragment in self._residual else delta
        payload = encode(corrected, codec)
        self._residual[fragment] = corrected - decode(payload)
        return payload
