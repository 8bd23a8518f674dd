"""How a Learner talks to a syncer: the interface and the fragment receiver every transport shares (the gRPC one,
and the in-process one in `diloco.inprocess`). Nothing here depends on the syncer's core."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from diloco.algorithm import codec
from diloco.algorithm.codec import tensor_checksum
from diloco.config import SyncConfig
from diloco.algorithm.fragments import TensorSpec
from diloco.learner.costs import PINNED
from diloco.learner.staging import DeviceDelta, LiveValues, Snapshot, StagedDelta


class SyncerError(RuntimeError):
    """The syncer refused us or cannot be reached; the message says what to do."""


@dataclass(frozen=True)
class JoinInfo:
    config: SyncConfig
    session: str
    fragments: list[tuple[int, int, torch.Tensor]]
    """(fragment, version, full fp32 values) of every current fragment."""
    data_position: int = 0
    """Where this learner's data shard resumes (from the syncer's ledger)."""
    start_position: int | None = None
    """Synchronous modes: the push-schedule position of the first step, in phase with the live peers (None: 1)."""


@dataclass(eq=False)
class PushJob:
    """One push. Δ is encoded where it is first needed (the sender thread), not on the training thread, and once:
    re-sends reuse the payload. Δ comes as `base` minus `local` (a Snapshot, or LiveValues read at encoding),
    already staged by the training thread (`staged`), or to be computed and encoded on the model's device (`device`,
    whose snapshot `local` also is)."""

    fragment: int
    base: torch.Tensor | None
    local: Snapshot | LiveValues | None
    base_version: int
    steps: int
    tokens: int
    seq: int
    data_position: int
    staged: StagedDelta | None = None
    final: bool = False
    """The learner's last push of this fragment: training has ended (`Learner.finish`)."""
    device: DeviceDelta | None = None
    _payload: codec.Encoded | None = None

    @property
    def delta(self) -> torch.Tensor:
        """Δ as an fp32 tensor (before the payload is made)."""
        if self.staged is not None:
            return self.staged.values.to(torch.float32)
        if self.device is not None:
            return self.device.delta()
        return self.base - self.local.host()

    def payload(self, codec_name: str, feedback: codec.ErrorFeedback | None = None) -> codec.Encoded:
        if self._payload is None:
            if feedback is not None:
                self._payload = feedback.encode(self.fragment, self.delta, codec_name)
            elif self.staged is not None:
                self._payload = codec.encode(self.staged.values, codec_name)
            elif self.device is not None:
                self._payload = self.device.payload(codec_name)
            elif isinstance(self.local, LiveValues):  # a chunk at a time, straight from the model's tensors
                base, local = self.base, self.local
                self._payload = codec.encode_from(base.numel(), lambda lo, hi: base[lo:hi] - local.read(lo, hi),
                                                  codec_name)
            else:  # a chunk at a time: Δ of a big fragment is never held whole
                self._payload = codec.encode_difference(self.base, self.local.host(), codec_name)
            if self.staged is not None:
                self.staged.release()
            if isinstance(self.local, Snapshot):
                self.local.release()
            self.base = self.local = self.staged = self.device = None  # the payload is all a re-send needs
        return self._payload


@dataclass(frozen=True)
class Arrival:
    fragment: int
    version: int
    values: torch.Tensor
    """The new full fp32 values of the fragment (also the learner's new base)."""
    refused: str = ""
    """Non-empty when the push was refused and these are the current values to resynchronise to."""
    seq: int = 0
    """The push this answers."""


class Transport(Protocol):
    def join(self, learner_id: str, specs: list[TensorSpec], initial: Callable[[int], list[torch.Tensor]]) -> JoinInfo: ...
    def push(self, job: PushJob) -> None: ...
    def arrivals(self, timeout: float | None = None) -> list[Arrival]: ...
    def report(self, **progress) -> None: ...
    @property
    def stop_requested(self) -> bool: ...
    @property
    def budget_progress(self) -> float | None: ...
    def take_phase_lead(self) -> float | None:
        """The syncer's latest word on how far this learner's push schedule runs ahead of its peers' (negative:
        behind), once: None until a new one arrives."""
    @property
    def wire_bytes(self) -> int: ...
    def close(self, timeout: float | None = None) -> None:
        """Deliver every queued push, then leave; raise SyncerError if that cannot be done within `timeout`."""


class HeartbeatNews:
    """What heartbeat replies tell a learner besides stop, kept alike by every transport."""

    _budget_progress: float | None = None
    _phase_lead: float | None = None

    @property
    def budget_progress(self) -> float | None:
        return self._budget_progress

    def take_phase_lead(self) -> float | None:
        lead, self._phase_lead = self._phase_lead, None
        return lead


@dataclass
class _InFlight:
    """A push whose answer has not arrived, as its Receiver sees it."""

    seq: int
    base: torch.Tensor | None
    """The values the push was computed from, when its apply reads them back (keep-overlap with a staged Δ)."""
    changes: list[codec.Encoded]
    """The encoded changes decoded into `base` since the push, in order."""
    answered: bool = False


class Receiver:
    """Turns publications into full fragment values, keeping exactly what the syncer believes we hold."""

    def __init__(self) -> None:
        self.held: dict[int, torch.Tensor] = {}
        self.keep_overlap = False
        self.inbox: queue.Queue[Arrival] = queue.Queue()
        self.pin_memory = False
        """Put arriving values in pinned memory (a CUDA learner copies them to the device without waiting)."""
        self._pushes: dict[int, _InFlight] = {}
        self._lock = threading.Lock()

    def reset(self, fragments: list[tuple[int, int, torch.Tensor]], keep_overlap: bool = False) -> None:
        """Start from the join's values; they are shared with the learner's bases. A change is decoded into the
        values it changes, no second copy of a big fragment. `keep_overlap`: the learner keeps a base until its
        next push, so a change to a fragment with no push awaiting its answer is decoded into a copy (the answers
        to a push are decoded in place; the changes decoded into its base are kept for its apply, see `pushed`)."""
        with self._lock:
            self.held = {i: v for i, _, v in fragments}
            self.keep_overlap = keep_overlap
            self._pushes = {}

    def forget(self, fragment: int) -> None:
        """Stop tracking a fragment that is never published again (frozen tensors set on join)."""
        self.held.pop(fragment, None)

    def pushed(self, fragment: int, seq: int, base: torch.Tensor | None = None) -> None:
        """The learner pushes `fragment` as push `seq` (call it before the push is sent: an in-process answer comes
        back at once). Until its answer arrives, changes to the fragment are decoded in place; those decoded into
        `base`, the values the push was computed from, are kept (encoded) for `settle`. Changes reach a learner
        only in answer to its pushes, so the syncer has this push, and its Δ was read from `base`, before any of
        them is decoded into it."""
        with self._lock:
            self._pushes[fragment] = _InFlight(seq, base, [])

    def settle(self, fragment: int, seq: int) -> list[codec.Encoded]:
        """The answer to push `seq` of `fragment` is applied: the encoded changes decoded into that push's base
        since it was made, in order (none after its answer: later ones, if any, went into a copy). Forgets it."""
        with self._lock:
            flight = self._pushes.get(fragment)
            if flight is None or flight.seq != seq:
                return []
            del self._pushes[fragment]
            return flight.changes

    def accept(self, pub: Publication, refused: str = "") -> bool:  # or anything with Publication's fields
        """Decode and queue one publication; False when its result does not match (a resync is needed). A link of
        a chain of changes (seq 0) updates what we hold and is queued like any other; the Learner applies only the
        answer to the push it waits for, and pushes are numbered from 1."""
        with self._lock:
            flight = self._pushes.get(pub.fragment)
            if flight is not None and flight.answered:
                flight = None  # only a push still waiting for its answer
        if pub.full:
            values = codec.decode(pub.payload)
        else:  # in place, a big fragment's change never needs a second copy of it. With keep-overlap only the changes
            # that reach a push before its answer (the answer included) go into its base, and each is kept for the
            # apply (see `pushed`); any other change goes into a copy, leaving the learner's base as it was
            held = self.held[pub.fragment]
            values = held if flight is not None or not self.keep_overlap else held.clone()
            codec.decode_add(pub.payload, values)  # a damaged payload raises before anything is written
        if flight is not None:
            with self._lock:
                if not pub.full and flight.base is values:
                    flight.changes.append(pub.payload)
                if pub.seq == flight.seq:
                    flight.answered = True
        if tensor_checksum(values) != pub.result_checksum:
            return False
        if self.pin_memory and not values.is_pinned():  # a change decoded in place into pinned values stays pinned
            values = values.pin_memory()
            PINNED.add(values.nbytes)
        self.held[pub.fragment] = values
        self.inbox.put(Arrival(pub.fragment, pub.version, values, refused, pub.seq))
        return True

    def drain(self, timeout: float | None) -> list[Arrival]:
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return out
