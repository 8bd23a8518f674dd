"""Outer-gradient codecs (docs/algorithm.md §6): fp32, bf16, int8 and int4 with one bf16 scale per block of values.

A payload is the codec's bytes for a flat fp32 vector plus a CRC-32 of those bytes; `decode` verifies the
checksum before it reads anything, so a corrupted payload is refused instead of merged.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

CODECS = ("fp32", "bf16", "int8", "int4")
BLOCK = 64  # values per scale: 0.25 extra bits per value for int4, a fine trade for outlier-robust scales
SCALE_BYTES = 2
"""Block scales are bf16: fp32's range, and a rounding (2^-9) far below a quantisation step (1/7 of the scale for
int4), which is made with the rounded scale. fp32 scales were 11% of an int4 payload, bf16 ones are 5.9%."""
_LEVELS = {"int8": 127, "int4": 7}  # symmetric: int4 uses -7..7 so that 0 is exact and the range is balanced


class CorruptPayload(ValueError):
    """A payload whose bytes do not match its checksum or its declared size."""


@dataclass(frozen=True)
class Encoded:
    codec: str
    numel: int
    data: bytes
    checksum: int


def checksum(data) -> int:
    """CRC-32 of any bytes-like object (a numpy array's buffer included, without copying it)."""
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
    return SCALE_BYTES * blocks + (values if codec == "int8" else values // 2)


CHUNK_BLOCKS = 2_048
"""Blocks encoded or decoded at a time (128K values, 512 KB of fp32): a fragment of any size needs only a few
hundred KB of temporaries, which stay in a core's cache. 1M-value chunks were 3-4x slower to decode and about 3x
slower to encode on one thread here (int4 decode of GPT-2's embedding fragment 0.19 s against 0.04 s)."""


def encode(x: torch.Tensor, codec: str) -> Encoded:
    """Encode a float tensor (flattened), converted to fp32 a chunk at a time."""
    x = x.detach().reshape(-1).cpu()
    return encode_from(x.numel(), lambda lo, hi: x[lo:hi].to(torch.float32), codec)


def view_fp32(x: torch.Tensor) -> Encoded:
    """An fp32 payload reading a flat fp32 CPU tensor's memory in place: full values sent without a copy. `x` must
    not change while the payload is in use."""
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError("view_fp32 needs a flat, contiguous fp32 CPU tensor")
    data = memoryview(x.numpy()).cast("B")
    return Encoded("fp32", x.numel(), data, checksum(data))


def encode_difference(a: torch.Tensor, b: torch.Tensor, codec: str) -> Encoded:
    """Encode a − b (two flat fp32 CPU tensors) without materialising the difference."""
    if a.shape != b.shape:
        raise ValueError(f"cannot encode the difference of {tuple(a.shape)} and {tuple(b.shape)} values")
    return encode_from(a.numel(), lambda lo, hi: a[lo:hi] - b[lo:hi], codec)


def encode_from(numel: int, values, codec: str) -> Encoded:
    """`values(lo, hi)` gives the fp32 values lo..hi; they are encoded a chunk at a time straight into the payload's
    buffer, so encoding holds the payload once (no list of parts joined into a second copy)."""
    check_codec(codec)
    data = bytearray(encoded_size(numel, codec))
    if data:
        encode_into(numel, values, codec, torch.frombuffer(data, dtype=torch.uint8))
    return Encoded(codec, numel, data, checksum(data))


def encode_into(numel: int, values, codec: str, out: torch.Tensor, step: int = CHUNK_BLOCKS * BLOCK) -> None:
    """Write a payload's bytes into `out`, a flat uint8 tensor of `encoded_size(numel, codec)` bytes on the device
    the values come from: `values(lo, hi)` gives the fp32 values lo..hi, called `step` values at a time (a whole
    number of blocks). On the host `out` is the payload's own buffer; on a GPU only these bytes then cross to the
    host (an eighth of fp32's for int4). The same arithmetic either way, so the bytes are the same."""
    check_codec(codec)
    if step % BLOCK:
        raise ValueError(f"step must be a whole number of {BLOCK}-value blocks, got {step}")
    if out.dtype != torch.uint8 or out.numel() != encoded_size(numel, codec):
        raise ValueError(f"{numel} values encoded as {codec} need {encoded_size(numel, codec)} uint8 bytes, "
                         f"got {out.numel()} {out.dtype}")
    if codec in ("fp32", "bf16"):
        width = 4 if codec == "fp32" else 2
        for lo in range(0, numel, step):
            hi = min(lo + step, numel)
            x = values(lo, hi).to(torch.float32 if codec == "fp32" else torch.bfloat16).contiguous()
            out[lo * width : hi * width].copy_(x.view(torch.uint8))
        return
    blocks = -(-numel // BLOCK)
    scales, body = out[: SCALE_BYTES * blocks], out[SCALE_BYTES * blocks :]
    per_block = BLOCK if codec == "int8" else BLOCK // 2
    for lo in range(0, numel, step):
        hi = min(lo + step, numel)
        first, last = lo // BLOCK, -(-hi // BLOCK)
        stored, packed = _packed_blocks(values(lo, hi), _LEVELS[codec], codec)
        scales[SCALE_BYTES * first : SCALE_BYTES * last].copy_(stored.view(torch.uint8))
        body[first * per_block : last * per_block].copy_(packed)


def _packed_blocks(x: torch.Tensor, levels: int, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 scales, quantised bytes) of one chunk of fp32 values, a whole number of blocks except at the end
    (zero-padded), on the values' device. int4 packs two values a byte: even index low nibble, odd index high."""
    blocks = -(-x.numel() // BLOCK)
    if x.numel() == blocks * BLOCK:
        padded = x.reshape(blocks, BLOCK).clone()
    else:
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
        padded[: x.numel()] = x
        padded = padded.view(blocks, BLOCK)
    stored, q = quantise_blocks(padded, levels)
    if codec == "int8":
        return stored, q.view(torch.uint8).view(-1)
    nibbles = (q + 8).to(torch.uint8).view(-1)  # 1..15
    return stored, nibbles[0::2] | (nibbles[1::2] << 4)


def quantise_blocks(padded: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of BLOCK fp32 values (overwritten) → (their bf16 scales, int8 values in −levels..levels), on the rows'
    device. A value decodes as its integer times its block's scale read back as fp32."""
    stored = (padded.abs().amax(dim=1) / levels).to(torch.bfloat16)
    scale = stored.to(torch.float32)  # quantise with the scale the receiver will read
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded.div_(safe[:, None])).clamp_(-levels, levels).to(torch.int8)
    return stored, q


def round_trip(x: torch.Tensor, codec: str) -> torch.Tensor:
    """The fp32 values a receiver decodes from `encode(x, codec)`, computed where `x` lives (a GPU included) without
    making the bytes or reading anything back to the host: bitwise what `decode(encode(x, codec))` gives."""
    x = x.detach().reshape(-1).to(torch.float32)
    if check_codec(codec) == "fp32":
        return x.clone()
    if codec == "bf16":
        return x.to(torch.bfloat16).to(torch.float32)
    blocks = -(-x.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    stored, q = quantise_blocks(padded.view(blocks, BLOCK), _LEVELS[codec])
    return q.to(torch.float32).mul_(stored.to(torch.float32)[:, None]).view(-1)[: x.numel()]


_INT4_PAIRS = np.array([[(b & 0x0F) - 8, (b >> 4) - 8] for b in range(256)], dtype=np.float32)
"""The two values (low nibble first) of every packed int4 byte, before scaling."""
_INT4_QUADS = np.concatenate([_INT4_PAIRS[np.arange(65536) & 0xFF], _INT4_PAIRS[np.arange(65536) >> 8]], axis=1)
"""The four values of every pair of packed int4 bytes read as one little-endian uint16 (1 MB): half the lookups of
`_INT4_PAIRS`, about twice as fast."""


def tensor_checksum(x: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes, read in place: no copy of the fragment."""
    return checksum(x.contiguous().numpy())


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in `x`: its min and max (NaN propagates into both) in one pass, 18× faster than
    isfinite(x).all() on one CPU thread."""
    if x.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def decode(payload: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat fp32 tensor a payload stands for; raises CorruptPayload if it was damaged. `out`: a flat fp32 CPU
    tensor of the payload's size to decode into (its contents are replaced), else a new one is made."""
    _verify(payload)
    if out is not None and (out.numel() != payload.numel or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"cannot decode {payload.numel} values into a tensor of {out.numel()} {out.dtype}")
    if payload.codec == "fp32":
        if out is None:  # the tensor owns a writable copy of the bytes: no second copy
            return torch.frombuffer(bytearray(payload.data), dtype=torch.float32)
        np.copyto(out.numpy(), np.frombuffer(payload.data, dtype=np.float32))
        return out
    if out is None:
        out = torch.empty(payload.numel, dtype=torch.float32)
    if payload.codec == "bf16":
        for lo, hi, chunk in decoded_chunks(payload):
            out[lo:hi] = chunk
        return out
    _decode_blocks_into(payload, out)
    return out


def decode_add(payload: Encoded, target: torch.Tensor) -> None:
    """target += the values a payload stands for, in place, a chunk at a time (target: flat fp32 CPU)."""
    _verify(payload)
    if target.numel() != payload.numel:
        raise CorruptPayload(f"payload of {payload.numel} values cannot be added to {target.numel()} values")
    for lo, hi, chunk in decoded_chunks(payload):
        target[lo:hi] += chunk


def finite(payload: Encoded, decoded: torch.Tensor) -> bool:
    """No NaN or Inf in `decoded`, the values of `payload`. For int8/int4 the block scales decide (a bounded integer
    times a finite scale is finite unless the product overflows), 64 times less to read than the values."""
    if payload.codec in ("fp32", "bf16"):
        return all_finite(decoded)
    blocks = -(-payload.numel // BLOCK)
    scales = _scales(memoryview(payload.data), blocks).numpy()
    limit = np.finfo(np.float32).max / _LEVELS[payload.codec]
    return bool(scales.size == 0 or np.abs(scales).max() <= limit)  # NaN compares false: refused too


def _verify(payload: Encoded) -> None:
    check_codec(payload.codec)
    expected = encoded_size(payload.numel, payload.codec)
    if len(payload.data) != expected:
        raise CorruptPayload(f"{payload.codec} payload of {payload.numel} values must be {expected} bytes, got {len(payload.data)}")
    if checksum(payload.data) != payload.checksum:
        raise CorruptPayload("payload checksum mismatch: the bytes were damaged in transit")


def _scales(data: memoryview, blocks: int) -> torch.Tensor:
    """A block payload's scales as fp32."""
    raw = np.frombuffer(data[: SCALE_BYTES * blocks], dtype=np.int16).copy()
    return torch.from_numpy(raw).view(torch.bfloat16).to(torch.float32)


def _decode_blocks_into(payload: Encoded, out: torch.Tensor) -> None:
    """Decode a verified int8/int4 payload straight into `out`, a chunk at a time (no temporaries but the last,
    partial block's)."""
    numel, data = payload.numel, memoryview(payload.data)
    blocks = -(-numel // BLOCK)
    scales = _scales(data, blocks)
    body = data[SCALE_BYTES * blocks :]
    per_block = BLOCK if payload.codec == "int8" else BLOCK // 2
    whole = numel // BLOCK  # blocks that fit in `out`; a partial last one goes through a temporary
    target = out.numpy()
    for first in range(0, blocks, CHUNK_BLOCKS):
        last = min(first + CHUNK_BLOCKS, blocks)
        raw = np.frombuffer(body[first * per_block : last * per_block], dtype=np.uint8)
        full = min(last, whole)
        if full > first:
            _dequantise(payload.codec, raw[: (full - first) * per_block], target[first * BLOCK : full * BLOCK],
                        scales[first:full])
        if last > full:  # the zero-padded last block
            tail = np.empty(BLOCK, dtype=np.float32)
            _dequantise(payload.codec, raw[(full - first) * per_block :], tail, scales[full:last])
            target[full * BLOCK :] = tail[: numel - full * BLOCK]


def _dequantise(codec: str, raw: np.ndarray, out: np.ndarray, scales: torch.Tensor) -> None:
    """Whole blocks of quantised bytes into `out` (fp32, BLOCK values per scale)."""
    if codec == "int8":
        np.copyto(out, raw.view(np.int8), casting="unsafe")
    else:  # four values per lookup in a table: far faster than unpacking nibbles with masks
        np.take(_INT4_QUADS, raw.view("<u2"), axis=0, out=out.reshape(-1, 4))  # BLOCK/2 bytes a block: even
    torch.from_numpy(out).view(-1, BLOCK).mul_(scales[:, None])


def chunk_scratch(numel: int) -> int:
    """fp32 values a `decoded_chunks` scratch buffer needs for `numel` values: a chunk and its scales."""
    blocks = min(-(-numel // BLOCK), CHUNK_BLOCKS)
    return blocks * BLOCK + blocks


def decoded_chunks(payload: Encoded, chunk: torch.Tensor | None = None):
    """(lo, hi, fp32 values lo..hi) of a verified payload, a chunk at a time; an int8 or int4 payload is decoded
    into `chunk` (fp32, at least `chunk_scratch(numel)` values: a chunk and its block scales) when given, so that
    decoding allocates nothing. Each chunk's values are valid until the next is made."""
    numel, data, step = payload.numel, memoryview(payload.data), CHUNK_BLOCKS * BLOCK
    if payload.codec in ("fp32", "bf16"):
        width, dtype = (4, np.float32) if payload.codec == "fp32" else (2, np.int16)
        for lo in range(0, numel, step):
            hi = min(lo + step, numel)
            raw = torch.from_numpy(np.frombuffer(data[lo * width : hi * width], dtype=dtype).copy())
            yield lo, hi, raw if payload.codec == "fp32" else raw.view(torch.bfloat16).to(torch.float32)
        return
    blocks = -(-numel // BLOCK)
    room = min(blocks, CHUNK_BLOCKS) * BLOCK
    if chunk is None or chunk.numel() < chunk_scratch(numel):
        chunk = torch.empty(chunk_scratch(numel), dtype=torch.float32)
    bf16_scales = np.frombuffer(data[: SCALE_BYTES * blocks], dtype=np.uint16)  # read in place
    scale_bits = chunk[room : room + min(blocks, CHUNK_BLOCKS)].numpy().view(np.uint32)
    body = data[SCALE_BYTES * blocks :]
    per_block = BLOCK if payload.codec == "int8" else BLOCK // 2
    for first in range(0, blocks, CHUNK_BLOCKS):
        last = min(first + CHUNK_BLOCKS, blocks)
        # a bf16 value is the top half of the fp32 with the same bits: widened in place, nothing allocated
        np.left_shift(bf16_scales[first:last], 16, out=scale_bits[: last - first], dtype=np.uint32)
        scales = torch.from_numpy(scale_bits[: last - first].view(np.float32))
        raw = np.frombuffer(body[first * per_block : last * per_block], dtype=np.uint8)
        values = chunk[: (last - first) * BLOCK]
        _dequantise(payload.codec, raw, values.numpy(), scales)
        lo, hi = first * BLOCK, min(last * BLOCK, numel)
        yield lo, hi, values[: hi - lo]


class ErrorFeedback:
    """Carries each fragment's quantisation error into its next outer gradient (optional, learner side)."""

    def __init__(self) -> None:
        self._residual: dict[int, torch.Tensor] = {}

    def encode(self, fragment: int, delta: torch.Tensor, codec: str) -> Encoded:
        corrected = delta + self._residual[fragment] if fragment in self._residual else delta
        payload = encode(corrected, codec)
        self._residual[fragment] = corrected - decode(payload)
        return payload
