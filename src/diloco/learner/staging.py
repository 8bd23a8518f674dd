"""Fragment copies between the model's device and host memory that never make the training thread wait.

On a CPU model pushed as int4 the training thread writes Δ = base − θ itself, rounded to bf16, into a reused buffer:
cut from one ring (`BufferRing`), given back once encoded or, when the overlap is kept, at its fragment's apply.
Half the memory of an fp32 copy, and after one cycle of the fragments no allocation and no page faults of fresh
memory on the training thread: staging and applies reuse their chunk buffers too (`Scratch`). bf16 keeps 8 significant bits, so its rounding (at most 2^-9 of each value) is far
below int4's quantisation step (1/7 of a block's largest value). Otherwise a snapshot is a plain fp32 copy. On CUDA
the fragment is first copied on the device (fast; the next training kernels wait only for that), then to pinned
host memory on a side stream; the sender thread waits for that copy, not the training thread. Merged values come back from pinned memory on the same side stream.
With `Learner(device_codec=True)` no fp32 copy goes to the host: the sender thread computes Δ from the device
snapshot and a device copy of the base and encodes it there (`DeviceDelta`); only the payload is copied back.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterator

import torch

from diloco.algorithm import codec
from diloco.learner.costs import PINNED

STAGE_CHUNK = 1 << 20
"""Values subtracted at a time when staging Δ: the fp32 temporaries stay a few MB."""

_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class Snapshot:
    """A fragment's values at one step: `device` (fp32, where the model lives) and `host()` (fp32 CPU) once ready."""

    def __init__(self, device_values: torch.Tensor, host_values: torch.Tensor, ready=None,
                 ring: BufferRing | None = None, token=None):
        self.device_values = device_values
        self._host = host_values
        self._ready = ready
        self._ring, self._token = ring, token

    def device(self) -> torch.Tensor:
        """The device copy, safe to use on the current stream (it was made on the side stream)."""
        if self.device_values.is_cuda:
            self.device_values.record_stream(torch.cuda.current_stream(self.device_values.device))
        return self.device_values

    def host(self) -> torch.Tensor:
        """The host copy; on CUDA this waits for the side stream's copy (call it off the training thread)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host

    def release(self) -> None:
        """The host copy is encoded: its span of the pinned ring may be cut again (the device copy stays)."""
        if self._ring is not None:
            self._ring.give_back(self._token)
        self._ring = self._token = None


def snapshot(tensors: list[torch.Tensor], pinned: BufferRing | None = None, to_host: bool = True) -> Snapshot:
    """Copy `tensors` (one fragment, in payload order) into one flat fp32 vector without blocking on the device; on
    CUDA the host copy is cut from `pinned` when given (else pinned memory of its own). `to_host=False`: the device
    copy only (its Δ is encoded on the device: DeviceDelta)."""
    device = tensors[0].device
    if device.type != "cuda":
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        return Snapshot(flat, flat)
    current, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(current)  # the step that produced these values comes first
    with torch.cuda.stream(side):
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        copied = torch.cuda.Event()
        copied.record(side)
    if not to_host:
        current.wait_event(copied)
        return Snapshot(flat, None)
    with torch.cuda.stream(side):
        if pinned is not None:
            host, token = pinned.take(flat.numel())
        else:
            host, token = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True), None
            PINNED.add(host.nbytes)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    current.wait_event(copied)  # the next optimizer step may overwrite the parameters only after the device copy
    return Snapshot(flat, host, ready, pinned, token)


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host fp32 values on `device`, copied on the side stream; the training stream waits for the copy, the
    training thread does not (values should be pinned; the receiver pins them for CUDA models)."""
    if device.type != "cuda":
        return values
    current, side = torch.cuda.current_stream(device), _side_stream(device)
    with torch.cuda.stream(side):
        out = values.to(device, non_blocking=True)
    current.wait_stream(side)
    out.record_stream(current)
    return out


DEVICE_STEP = 1 << 23
"""Values a GPU encodes at a time: a few dozen kernel launches for the largest fragment, 32 MB temporaries."""


class DeviceDelta:
    """Δ = base − θ at a push, computed and encoded where the model lives, by the sender thread: on a GPU on the side
    stream, so that only the encoded payload (an eighth of the fp32 values for int4) crosses to the host, through
    `pinned` (uint8, reused), and no host thread quantises. `base` holds the values the syncer believes we hold (on
    the model's device), `local` the device snapshot of θ. The bytes are those `codec.encode` makes of the same Δ."""

    def __init__(self, base: torch.Tensor, local: Snapshot, pinned: BufferRing | None = None):
        if base.numel() != local.device_values.numel():
            raise ValueError(f"the base has {base.numel()} values, the snapshot {local.device_values.numel()}")
        self.base, self.local, self.pinned = base, local, pinned

    def delta(self) -> torch.Tensor:
        """Δ as fp32 host values (error feedback reads it whole)."""
        return (self.base - self.local.device_values).cpu()

    def payload(self, codec_name: str) -> codec.Encoded:
        base, theta, numel = self.base, self.local.device_values, self.base.numel()
        if not theta.is_cuda:
            return codec.encode_difference(base, theta, codec_name)
        size = codec.encoded_size(numel, codec_name)
        side = _side_stream(theta.device)
        with torch.cuda.stream(side):  # after the snapshot and the base's copy, both made on this stream
            out = torch.empty(size, dtype=torch.uint8, device=theta.device)
            codec.encode_into(numel, lambda lo, hi: base[lo:hi] - theta[lo:hi], codec_name, out, DEVICE_STEP)
            if self.pinned is not None:
                host, token = self.pinned.take(size)
            else:
                host, token = torch.empty(size, dtype=torch.uint8, pin_memory=True), None
                PINNED.add(host.nbytes)
            host.copy_(out, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        copied.synchronize()
        data = bytearray(host.numpy())  # the payload outlives the pinned span (re-sends)
        if self.pinned is not None:
            self.pinned.give_back(token)
        return codec.Encoded(codec_name, numel, data, codec.checksum(data))


class LiveValues:
    """A fragment's current values, read only when its payload is encoded: for pushes made when training has ended
    (`Learner.finish`), so that flushing every fragment never holds a copy of them all at once."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = [t.detach().reshape(-1) for t in tensors]

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 values lo..hi of the fragment's tensors laid end to end (on the CPU)."""
        parts, offset = [], 0
        for t in self.tensors:
            a, b = max(lo, offset), min(hi, offset + t.numel())
            if a < b:
                parts.append(t[a - offset : b - offset].to("cpu", torch.float32))
            offset += t.numel()
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def host(self) -> torch.Tensor:
        """All the values as one flat fp32 CPU tensor."""
        return self.read(0, sum(t.numel() for t in self.tensors))


class Scratch:
    """fp32 chunk buffers an apply reuses (kept_progress): allocated the first time they are needed."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    def get(self, i: int, numel: int) -> torch.Tensor:
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(0, dtype=torch.float32))
        if self.buffers[i].numel() < numel:
            self.buffers[i] = torch.empty(numel, dtype=torch.float32)
        return self.buffers[i][:numel]


class BufferRing:
    """One flat buffer that staged values are cut from, taken in push order and mostly given back in that order:
    staged Δs (bf16, CPU), each kept until encoded or, with keep-overlap, until its fragment's apply `overlap`
    steps later, and a CUDA model's
    host copies of its snapshots (fp32, pinned), each kept until the sender has encoded it. Once the ring has held
    one cycle of the fragments nothing is allocated. A take that finds no room replaces the ring by one twice as
    large (what is still in the old one keeps it alive until given back), up to `limit` values, the fragments' sum:
    at most one of each fragment is ever in flight. Beyond it, a take gets a buffer of its own. Thread-safe: the
    sender gives snapshots back."""

    def __init__(self, limit: int, dtype: torch.dtype = torch.bfloat16, pinned: bool = False):
        self.limit, self.dtype, self.pinned = limit, dtype, pinned
        self._lock = threading.Lock()
        self.buffer = torch.empty(0, dtype=dtype)
        self.generation = 0
        self.lent: deque[list] = deque()
        """[lo, hi, returned] of this generation's spans, in the order taken."""
        self.allocations = 0

    def take(self, numel: int) -> tuple[torch.Tensor, tuple[int, list] | None]:
        """(a flat view of `numel` values, the token to give it back with)."""
        with self._lock:
            lo = self._room(numel)
            if lo is None:
                size = min(self.limit, max(2 * self.buffer.numel(), 2 * numel))
                self.allocations += 1
                if size < numel or size <= self.buffer.numel():  # at its limit: a buffer of its own
                    return self._allocate(numel), None
                self.buffer = self._allocate(size)
                self.generation, self.lent, lo = self.generation + 1, deque(), 0
            span = [lo, lo + numel, False]
            self.lent.append(span)
            return self.buffer[lo : lo + numel], (self.generation, span)

    def give_back(self, token: tuple[int, list] | None) -> None:
        with self._lock:
            if token is None or token[0] != self.generation:
                return  # a buffer of its own, or cut from a ring since replaced: it goes when its last view does
            token[1][2] = True
            while self.lent and self.lent[0][2]:
                self.lent.popleft()

    def _allocate(self, numel: int) -> torch.Tensor:
        values = torch.empty(numel, dtype=self.dtype, pin_memory=self.pinned)
        if self.pinned:
            PINNED.add(values.nbytes)
        return values

    def _room(self, numel: int) -> int | None:
        size = self.buffer.numel()
        if not self.lent:
            return 0 if numel <= size else None
        tail, head = self.lent[0][0], self.lent[-1][1]
        if self.lent[-1][0] >= tail:  # not wrapped: room after head, then before tail
            if head + numel <= size:
                return head
            return 0 if numel <= tail else None
        return head if head + numel <= tail else None


class StagedDelta:
    """Δ = base − θ of one fragment at one step, as flat bf16 values cut from a ring; `release()` once encoded. A
    `kept` Δ outlives its encoding (`drop()` at its apply): keep-overlap reads θ at the push back from it (base − Δ) when the
    merged fragment is applied, at half the memory of an fp32 snapshot."""

    def __init__(self, base: torch.Tensor, tensors: list[torch.Tensor], ring: BufferRing, kept: bool = False,
                 scratch: Scratch | None = None):
        self.kept = kept
        self._ring = ring
        self.values, self._token = ring.take(base.numel())
        offset = 0
        wide = (scratch if scratch is not None else Scratch()).get(0, min(STAGE_CHUNK, base.numel()))
        with torch.no_grad():
            for t in tensors:
                flat = t.detach().reshape(-1)
                for lo in range(0, flat.numel(), STAGE_CHUNK):
                    hi = min(lo + STAGE_CHUNK, flat.numel())
                    # in fp32 first: subtracting straight into bf16 makes an fp32 temporary of the chunk each time
                    torch.sub(base[offset + lo : offset + hi], flat[lo:hi], out=wide[: hi - lo])
                    self.values[offset + lo : offset + hi].copy_(wide[: hi - lo])
                offset += flat.numel()

    def release(self) -> None:
        """The values are no longer needed (their payload is made): their span of the ring may be cut again. A kept
        Δ stays until the learner drops it on apply."""
        if not self.kept:
            self.drop()

    def drop(self) -> None:
        """Give the values' span back (a kept Δ once applied)."""
        if self._ring is not None:
            self._ring.give_back(self._token)
        self.values, self._ring, self._token = None, None, None


def kept_progress(values: torch.Tensor, base: torch.Tensor, changes: list[codec.Encoded], delta: torch.Tensor,
                  scratch: Scratch | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(lo, hi, fp32 values lo..hi of (Θ − base at push) + Δ), a chunk at a time: what a keep-overlap apply adds to
    the local values, θ ← θ + (Θ − base at push) + Δ, which is Θ + (θ − θ at push) since θ at push = base − Δ.

    The base a push was computed from is not kept whole: the changes that answer it are decoded into it in place.
    `base` is that tensor as it is now, `changes` the encoded changes decoded into it since the push (in order),
    `values` the merged values Θ (`base` itself unless a full answer replaced it), `delta` the push's staged Δ.
    Then Θ − base at push = (values − base) + Σ changes, summed here as (values − base) + change₁ + … + Δ: the same
    value as Θ − base at push + Δ up to fp32 rounding (decoding a change into the base rounded it, to |base|'s
    precision; its decoded values are added here as they are). Chunk buffers are reused: use each before the next."""
    numel, step = base.numel(), codec.CHUNK_BLOCKS * codec.BLOCK
    scratch = scratch if scratch is not None else Scratch()
    # payloads verified when they were decoded into the base
    decoded = [codec.decoded_chunks(c, scratch.get(1 + i, codec.chunk_scratch(numel))) for i, c in enumerate(changes)]
    buffer = scratch.get(0, min(step, numel))
    for lo in range(0, numel, step):
        hi = min(lo + step, numel)
        gain = buffer[: hi - lo]
        if values is base:
            gain.zero_()
        else:
            torch.sub(values[lo:hi], base[lo:hi], out=gain)
        for chunks in decoded:
            at, to, chunk = next(chunks)
            if (at, to) != (lo, hi):
                raise ValueError(f"a change's chunk {at}..{to} is not {lo}..{hi}")
            gain += chunk
        widened = scratch.get(1 + len(changes), hi - lo)
        widened.copy_(delta[lo:hi])  # adding bf16 to fp32 directly makes an fp32 temporary of the chunk
        gain += widened
        yield lo, hi, gain
