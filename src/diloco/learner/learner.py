"""The Learner: wraps a user's model and inner optimizer and does everything DiLoCo needs between steps.

The user's loop stays as it is and calls `learner.step(tokens)` after each optimizer step. On the training
thread this only snapshots fragments (a device copy on CUDA) and writes merged values back; Δ, encoding, sending
and receiving run in the transport's background threads (docs/algorithm.md §3). A learner may be a torch.distributed
job of several ranks (`process_group=`): its leader talks to the syncer and the other ranks follow (island.py).
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass

import torch
from torch import nn

from diloco.config import SyncConfig
from diloco.algorithm.codec import encoded_size
from diloco.algorithm.fragments import Fragment, full, part, plan_fragments, scatter, tensor_specs
from diloco.learner import writes
from diloco.learner.costs import StepCosts
from diloco.learner.gil import GIL_SWITCH_SECONDS, lower_switch_interval, restore_switch_interval
from diloco.learner.initial import InitialModel
from diloco.learner.island import Island
from diloco.learner.model_tensors import ModelTensors, checked_state
from diloco.learner.staging import (BufferRing, DeviceDelta, LiveValues, Scratch, Snapshot, StagedDelta,
                                    kept_progress, snapshot, to_device)
from diloco.learner.transport import Arrival, PushJob, Receiver, SyncerError, Transport
from diloco.algorithm.schedule import due

log = logging.getLogger("diloco.learner")
RESULT_WAIT = 30.0
"""Seconds `finish` waits for merged results still out before pushing what is left (bounded by its timeout)."""

ALIGN_EVERY = 4
"""Least number of steps between two phase corrections: time for the syncer to see the last one."""


@dataclass
class FragmentSlot:
    """Learner-side state of one fragment."""

    fragment: Fragment
    base: torch.Tensor
    version: int
    steps: int = 0
    tokens: int = 0
    pushed_at: int | None = None
    """Local step of the push whose merged result we still await (None: nothing in flight)."""
    pushed_seq: int = 0
    """Sequence number of that push: only the answer to it is applied."""
    ready: Arrival | None = None
    """A merged result that arrived and waits for its apply step."""
    device_base: torch.Tensor | None = None
    """`base` on the model's device, for Δs encoded there (`device_codec`); None until the next push needs it."""
    pushed: tuple[Snapshot | StagedDelta, int, int] | None = None
    """(local values, or Δ = base − them, steps, tokens) at the push, for keeping the overlapped progress on apply.
    With a staged Δ, `base` is the same tensor until the apply, but the answers to the push may have been decoded
    into it: the receiver keeps those changes for the apply (Receiver.settle)."""


def _refuse_lone_rank(model: nn.Module) -> None:
    """A DDP model on several ranks with a Learner on one of them would train while its ranks drift apart."""
    group = getattr(model, "process_group", None)
    if isinstance(model, nn.parallel.DistributedDataParallel) and group is not None:
        import torch.distributed as dist

        ranks = dist.get_world_size(group)
        if ranks > 1:
            raise ValueError(f"this model is DistributedDataParallel over {ranks} ranks: create the Learner on every "
                             f"rank with process_group=... (the DDP group), or the ranks would drift apart")


class Learner:
    """One learner of a run.

    Args:
        model: the replica to train (bare, or wrapped in DDP / FSDP2 / torch.compile); its whole state is replaced
            by the global model on join.
        transport: how to reach the syncer (`GrpcTransport("host:port")` or an in-process one). In an island only
            the leader's is used; other ranks may pass None.
        learner_id: a stable name; re-joining under the same id resumes this learner's ledger.
        embedding_names: parameter names to merge as embeddings (default: every nn.Embedding weight).
        speed: the speed factor reported to the syncer (only informational).
        process_group: for a learner made of several torch.distributed ranks (torchrun; DDP or FSDP2): every rank
            creates its Learner with the same group and calls `step` and `finish` in step; rank 0 of the group talks
            to the syncer.
        gil_switch_seconds: Python's thread switch interval from here to `finish` or `close` (`sys.setswitchinterval`,
            process-wide; the previous value comes back after). None leaves it alone. See GIL_SWITCH_SECONDS.
        device_codec: compute each push's Δ and encode it on the model's device, in the sender thread (on a GPU, on a
            side stream): only the encoded payload crosses to the host (an eighth of the fp32 values for int4) and no
            host thread quantises. Costs one fp32 copy of the pushed fragments on the device (the base). Off: the
            fp32 snapshot is copied to pinned host memory and encoded there (on a CPU model, Δ staged in bf16).
    """

    def __init__(self, model: nn.Module, transport: Transport | None, learner_id: str, *,
                 embedding_names: set[str] | None = None, speed: float | None = None, process_group=None,
                 gil_switch_seconds: float | None = GIL_SWITCH_SECONDS, device_codec: bool = False):
        if gil_switch_seconds is not None and not 0 < gil_switch_seconds < 1:
            raise ValueError(f"gil_switch_seconds must be between 0 and 1 second, got {gil_switch_seconds}")
        self.model = model
        self.transport = transport
        self.learner_id = learner_id
        self.speed = speed
        self.device_codec = bool(device_codec)
        self.island = Island(process_group) if process_group is not None else None
        self.leader = self.island is None or self.island.leader
        if self.leader and transport is None:
            raise ValueError("the learner (or, in a process group, its rank 0) needs a transport to reach the syncer")
        if self.island is None:
            _refuse_lone_rank(model)
        self.specs = tensor_specs(model, embedding_names)
        self._model_tensors: ModelTensors | None = None
        state = self._state()
        floats = [t for t in state.values() if t.is_floating_point()]
        self.device = floats[0].device if floats else torch.device("cpu")
        self.sharded = any(hasattr(t, "device_mesh") for t in state.values())
        if self.sharded and self.island is None:
            raise ValueError("this model's tensors are sharded (FSDP2): create the Learner on every rank with "
                             "process_group=... (the group the model is sharded over)")
        if not self.sharded:  # FSDP2 swaps its parameters without registering them: walked at every use there
            self._model_tensors = ModelTensors(model, self.specs)
        self.step_count = 0
        self.tokens = 0
        self.pushes = self.applied = self.skipped = self.refused = self.flushed = self.realigned = 0
        self.costs = StepCosts()
        """What `step` costs the training loop: `costs.summary()` (host time, waits, pinned bytes)."""
        self._shift = 0
        """Steps this learner's push schedule runs ahead of its step count (phase alignment)."""
        self._aligned_at = -ALIGN_EVERY
        self._hold = 0
        """Steps left to stay at the same schedule position (catching up with peers that are behind)."""
        self._seq = 0
        self._last_step_at: float | None = None
        self._step_seconds: float | None = None
        self._tokens_per_second: float | None = None
        self._last_report = 0.0
        self._error: str | None = None
        """A leader's failure, held until the other ranks of its island have heard of it."""
        self._stop = False
        self._progress: float | None = None
        self._finished = False
        # before the transport's threads start; given back when the learner is done
        self._switch_held = gil_switch_seconds is not None and self.leader and lower_switch_interval(gil_switch_seconds)
        try:
            self._join(state)
        except BaseException:
            self._release_switch()
            raise

    def _release_switch(self) -> None:
        if self._switch_held:
            self._switch_held = False
            restore_switch_interval()

    # ---- joining ------------------------------------------------------------------------------------------
    def _join(self, state: dict[str, torch.Tensor]) -> None:
        whole = None
        if self.sharded:  # the first learner uploads whole tensors; gathering a shard is a collective
            whole = {s.name: full(state[s.name]) for s in self.specs if s.kind != "alias"}
        info = None
        if self.leader:
            if self.device.type == "cuda" and getattr(self.transport, "receiver", None) is not None:
                self.transport.receiver.pin_memory = True
            info = self._lead(self.transport.join, self.learner_id, self.specs, self._initial_fragments(whole or state))
        if info is not None and info.start_position is not None:
            self._shift = info.start_position - 1 - self.step_count  # the next step is at that position
        config_json, position = (info.config.to_json(), info.data_position) if info else (None, 0)
        if self.island:
            config_json, position, self._error = self.island.share((config_json, position, self._error))
        if self._error is not None:
            raise SyncerError(self._error)
        self.config: SyncConfig = info.config if info else SyncConfig.from_json(config_json)
        self.data_position = position
        self.layout = plan_fragments(self.specs, self.config.fragments, self.config.split_tensors)
        values = {i: (version, v) for i, version, v in info.fragments} if info else {}
        self.slots: list[FragmentSlot] = []
        for fragment in self.layout:
            version, flat = values.get(fragment.index, (0, None))
            self._write(fragment, flat)
            if self.leader and self._pushable(fragment):
                self.slots.append(FragmentSlot(fragment, flat, version))
            elif self.leader and getattr(self.transport, "receiver", None) is not None:
                self.transport.receiver.forget(fragment.index)
        self._slot = {slot.fragment.index: slot for slot in self.slots}
        receiver = getattr(self.transport, "receiver", None) if self.leader else None
        self._receiver: Receiver | None = receiver if isinstance(receiver, Receiver) else None
        """Where merged values are decoded (None for a transport without one: its values never change in place)."""
        total = sum(s.fragment.numel for s in self.slots)
        self._deltas = BufferRing(total)
        """Where Δs are staged (CPU, int4): reused once it has held a cycle of the fragments."""
        cuda = self.device.type == "cuda"
        self._pinned = BufferRing(total, torch.float32, pinned=True) if cuda and not self.device_codec else None
        """Where a CUDA model's snapshots are copied to the host, until encoded."""
        encoded = sum(encoded_size(s.fragment.numel, self.config.codec) for s in self.slots)
        self._encoded = BufferRing(encoded, torch.uint8, pinned=True) if cuda and self.device_codec else None
        """Where payloads encoded on a GPU are copied to the host (`device_codec`)."""
        self._scratch, self._stage_scratch = Scratch(), Scratch()
        """Chunk buffers a keep-overlap apply, and staging a Δ, reuse."""

    def _pushable(self, fragment: Fragment) -> bool:
        return fragment.role == "params" or (fragment.role == "buffers" and self.config.sync_buffers)

    def _initial_fragments(self, state: dict[str, torch.Tensor]) -> InitialModel:
        return InitialModel(self.specs, state)

    def _state(self) -> dict[str, torch.Tensor]:
        """The model's tensors by name, checked against what it joined with."""
        if self._model_tensors is None:
            return checked_state(self.model, self.specs)
        return self._model_tensors.state()

    # ---- what the syncer says -----------------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True once the syncer says the run's budget is spent (in an island: as of the last step, on every rank)."""
        return self._stop if self.island else self.transport.stop_requested

    @property
    def budget_progress(self) -> float | None:
        """Share of the run's budget (tokens or duration) spent, as the syncer last said; None if it has none.
        Drive a learning-rate decay with it so that every learner decays together."""
        return self._progress if self.island else self.transport.budget_progress

    @property
    def schedule_position(self) -> int:
        """This learner's position in the push schedule: its step count plus the shifts that keep it in phase
        with its peers. Every position up to it has been passed exactly once."""
        return self.step_count + self._shift

    # ---- the step -----------------------------------------------------------------------------------------
    def step(self, tokens: int, loss: float | None = None, data_position: int | None = None) -> None:
        """Call after every inner optimizer step with the tokens that step consumed (in an island: on every rank,
        with that rank's tokens)."""
        if self._finished:
            raise RuntimeError(f"learner {self.learner_id!r}: step() after finish(); this learner has left the run "
                               f"(create a new Learner to rejoin)")
        try:
            tokens = operator.index(tokens)
        except TypeError:
            raise ValueError(f"tokens must be a whole number, got {tokens!r}") from None
        if tokens <= 0:
            raise ValueError(f"tokens must be positive (the tokens this step consumed), got {tokens}: a step without "
                             f"tokens would weigh nothing and never advance a token budget")
        started = time.perf_counter()
        if self.island:
            tokens, loss = self.island.reduce_step(tokens, loss)
        self.step_count += 1  # on every rank: loops that count steps end together
        self.tokens += tokens
        if data_position is not None:
            self.data_position = data_position
        due_now = self._lead(self._advance, tokens) or []
        if self.sharded:
            due_now = self._share(due_now)
        for p in due_now:
            self._push(p)
        applies = self._lead(self._ready) or []
        if self.island:
            applies = self._share(applies)
        for p, local in applies:
            self._apply(p, local)
        if self.leader:
            self._lead(self._maybe_report, loss)
        self.costs.step(time.perf_counter() - started)

    def _lead(self, fn, *args):
        """Run `fn` on the leader. In an island a SyncerError is held until every rank has heard of it."""
        if not self.leader or self._error is not None:
            return None
        if self.island is None:
            return fn(*args)
        try:
            return fn(*args)
        except SyncerError as e:
            self._error = str(e)
            return None

    def _share(self, value):
        """The leader's value, stop and progress on every rank; raises on every rank if the leader failed."""
        if self.island is None:
            return value
        if self.leader:
            self._stop, self._progress = self.transport.stop_requested, self.transport.budget_progress
        value, self._stop, self._progress, self._error = self.island.share((value, self._stop, self._progress,
                                                                             self._error))
        if self._error is not None:
            raise SyncerError(self._error)
        return value

    def _advance(self, tokens: int) -> list[int]:
        """Count the step in each fragment; returns the fragments to push now."""
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_seconds = now - self._last_step_at
            self._tokens_per_second = tokens / max(self._step_seconds, 1e-9)
        self._last_step_at = now
        for slot in self.slots:
            slot.steps += 1
            slot.tokens += tokens
        out = []
        for p in self._due():
            if self._slot[p].pushed_at is None:
                out.append(p)
            else:
                self.skipped += 1  # the last push's result is still out; its Δ already covers this progress
        return out

    def _due(self) -> list[int]:
        """Fragments to push now: those due at this learner's position in the schedule (its step plus a shift that
        keeps it in phase with its peers, docs/algorithm.md §2); buffers go with fragment 0."""
        pushes = self._due_params()
        buffers = [s.fragment.index for s in self.slots if s.fragment.role == "buffers"]
        return pushes + (buffers if 0 in pushes else [])

    def _due_params(self) -> list[int]:
        H, P = self.config.sync_every, self.config.fragments
        if self._hold:  # still ahead of its peers: stay at the same position
            self._hold -= 1
            self._shift -= 1
            return []
        position = self.schedule_position
        lead = self.transport.take_phase_lead() if self.config.align_pushes else None
        if lead is None or abs(lead) < 1 or self.step_count - self._aligned_at < ALIGN_EVERY:
            return due(position, H, P)
        steps = round(abs(lead))
        self.realigned += 1
        if lead > 0:  # ahead: stay at the last step's position for `steps` steps; those fragments go later
            self._hold, self._shift = steps - 1, self._shift - 1
            self._aligned_at = self.step_count + steps - 1
            return []
        # behind: push the fragments of the next `steps` positions now as well
        self._shift += steps
        self._aligned_at = self.step_count
        return [p for u in range(position, position + steps + 1) for p in due(u, H, P)]

    def _tensors(self, fragment: Fragment) -> list[torch.Tensor]:
        if self._model_tensors is not None:
            return self._model_tensors.tensors(fragment.specs)
        state = self._state()
        return [part(state[s.name], s) for s in fragment.specs]

    def _local(self, fragment: Fragment) -> list[torch.Tensor]:
        """The fragment's whole local tensors (all-gathered when sharded: every rank calls this together)."""
        if self.sharded:
            state = self._state()
            return [part(full(state[s.name]), s) for s in fragment.specs]
        return self._tensors(fragment)

    def _push(self, p: int, finishing: bool = False) -> None:
        """Push fragment p's progress (in a sharded island every rank calls this: the gather is a collective).
        `finishing`: training has ended, so the values are read when the sender encodes them, one push at a time."""
        fragment = self.layout[p]
        local = self._local(fragment)
        if not self.leader:
            return
        slot = self._slot[p]
        keep = self.config.keep_overlap and fragment.role == "params" and not finishing
        taken = staged = on_device = None
        if finishing and not self.sharded:
            taken = LiveValues(local)
        elif self.device_codec:
            taken = snapshot(local, to_host=False)
            if slot.device_base is None:
                slot.device_base = to_device(slot.base, self.device)
            on_device = DeviceDelta(slot.device_base, taken, self._encoded)
        elif not self.sharded and self.device.type == "cpu" and self.config.codec == "int4":
            staged = StagedDelta(slot.base, local, self._deltas, keep, self._stage_scratch)
        else:
            taken = snapshot(local, self._pinned)
        if slot.pushed is not None and isinstance(slot.pushed[0], StagedDelta):
            slot.pushed[0].drop()  # a push whose answer was never applied: only the latest push's answer is
            slot.pushed = None
        if keep:
            slot.pushed = (staged if staged is not None else taken, slot.steps, slot.tokens)
        self._seq += 1
        if self._receiver is not None:  # before the push: an in-process answer arrives within it
            self._receiver.pushed(p, self._seq, slot.base if keep and staged is not None else None)
        self.transport.push(PushJob(p, slot.base, taken, slot.version, slot.steps, slot.tokens, self._seq,
                                    self.data_position, staged, final=finishing, device=on_device))
        slot.pushed_at, slot.pushed_seq = self.step_count, self._seq
        self.pushes += 1

    def _collect(self, block: bool, timeout: float | None = None) -> None:
        for arrival in self.transport.arrivals(timeout if block else None):
            slot = self._slot.get(arrival.fragment)
            if slot is None:
                continue
            if slot.pushed_at is None and arrival.seq == 0 and self.config.publish_to == "live":
                if arrival.version > slot.version:  # published to every live learner: applied at once (overwrite)
                    slot.ready = arrival
                continue
            if slot.pushed_at is None or arrival.seq != slot.pushed_seq:
                continue  # an answer to an earlier (re-sent) push: applying it would count progress twice
            if arrival.refused:
                self.refused += 1
            slot.ready = arrival

    def _ready(self) -> list[tuple[int, bool]]:
        """(fragment, whether its apply reads the local values) for every merged fragment to apply now."""
        self._collect(block=False)
        out = []
        for slot in self.slots:
            if slot.pushed_at is None and slot.ready is not None:  # unasked (publish_to live): nothing to wait for
                out.append((slot.fragment.index, False))
                continue
            if slot.pushed_at is None or self.step_count < slot.pushed_at + self.config.overlap:
                continue
            while slot.ready is None and self.config.wait_for_merge:
                waiting = time.perf_counter()
                self._collect(block=True, timeout=1.0)
                self.costs.wait(time.perf_counter() - waiting)
                if self.transport.stop_requested and slot.ready is None:
                    break
            if slot.ready is not None:
                out.append((slot.fragment.index, self._reads_local(slot)))
        return out

    def _reads_local(self, slot: FragmentSlot) -> bool:
        if slot.fragment.role != "params" or slot.ready is None or slot.ready.refused:
            return False
        return (self.config.keep_overlap and slot.pushed is not None) or bool(self.config.blend)

    def _apply(self, p: int, reads_local: bool) -> None:
        """Write a merged fragment into the model (every rank calls this together in an island)."""
        fragment = self.layout[p]
        if self.island is None:
            self._apply_in_place(self._slot[p], reads_local)
        else:
            local = self._local(fragment) if reads_local and (self.leader or self.sharded) else None
            values = self._merged_values(self._slot[p], local) if self.leader else None
            self._write(fragment, values)
        self.applied += 1

    def _apply_in_place(self, slot: FragmentSlot, reads_local: bool) -> None:
        """Apply in place (learner/writes.py): no flat copy of the fragment on the training thread."""
        keep = reads_local and self.config.keep_overlap and slot.pushed is not None
        staged = slot.pushed[0] if keep and isinstance(slot.pushed[0], StagedDelta) else None
        tensors = self._tensors(slot.fragment)
        if staged is not None:  # θ + (Θ − base at push) + Δ = Θ + (θ − θ at push), θ at push being base − Δ
            changes = self._changes_since_push(slot)
            writes.add_gains(tensors, kept_progress(slot.ready.values, slot.base, changes, staged.values,
                                                    self._scratch))
            self._settle(slot, keep=keep)
            return
        values = to_device(slot.ready.values, self.device)
        writes.write(tensors, values, slot.pushed[0].device() if keep else None,
                     self.config.blend if reads_local and not keep else None)
        self._settle(slot, keep=keep)
        if self.device_codec:
            slot.device_base = values  # already on the device: the next Δ is taken from it

    def _changes_since_push(self, slot: FragmentSlot) -> list:
        """The encoded changes decoded into the slot's base since its push (see Receiver.settle); the receiver
        forgets the push."""
        return self._receiver.settle(slot.fragment.index, slot.pushed_seq) if self._receiver is not None else []

    def _merged_values(self, slot: FragmentSlot, local: list[torch.Tensor] | None) -> torch.Tensor:
        """The fragment's new values as one flat vector on the model's device (islands broadcast it)."""
        keep = local is not None and self.config.keep_overlap and slot.pushed is not None
        values = slot.ready.values
        if local is not None:
            now = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in local])
            taken = slot.pushed[0] if keep else None
            if isinstance(taken, StagedDelta):  # θ + (Θ − base at push) + Δ: the steps taken since the push stay
                for lo, hi, gain in kept_progress(values, slot.base, self._changes_since_push(slot), taken.values,
                                                  self._scratch):
                    now[lo:hi] += gain.to(now.device)
                values = now
            elif keep:  # Θ + (θ − θ at push): the steps taken since the push stay
                values = to_device(values, self.device) + (now - taken.device())
            else:
                values = self.config.blend * now + (1 - self.config.blend) * to_device(values, self.device)
        else:
            values = to_device(values, self.device)
        self._settle(slot, keep)
        return values

    def _settle(self, slot: FragmentSlot, keep: bool) -> None:
        """After an apply: the merged values are the new base; kept progress counts toward the next push."""
        arrival = slot.ready
        self._changes_since_push(slot)  # the receiver forgets the push (an answer applied without reading them)
        if slot.pushed is not None and isinstance(slot.pushed[0], StagedDelta):
            slot.pushed[0].drop()
        steps, tokens = (slot.steps - slot.pushed[1], slot.tokens - slot.pushed[2]) if keep else (0, 0)
        slot.base, slot.version, slot.device_base = arrival.values, arrival.version, None
        slot.steps, slot.tokens, slot.pushed = steps, tokens, None
        slot.pushed_at, slot.ready = None, None

    def _write(self, fragment: Fragment, flat: torch.Tensor | None) -> None:
        """Set the fragment's tensors to the leader's flat values (broadcast first in an island)."""
        if self.island is not None:
            flat = self.island.broadcast(flat, fragment.numel)
        scatter(flat, self._state(), fragment)

    def _maybe_report(self, loss: float | None) -> None:
        now = time.monotonic()
        if now - self._last_report >= self.config.heartbeat_seconds / 2:
            self._report(loss, now)

    def _report(self, loss: float | None, now: float) -> None:
        self._last_report = now
        self.transport.report(
            step=self.step_count, tokens_trained=self.tokens, loss=loss, data_position=self.data_position,
            step_seconds=self._step_seconds, pushes=self.pushes, applied=self.applied, speed=self.speed,
            tokens_per_second=self._tokens_per_second,
        )

    # ---- leaving ------------------------------------------------------------------------------------------
    def finish(self, timeout: float | None = 300.0) -> None:
        """End of training: apply results still out, push all remaining progress, and leave the run once the syncer
        has every push. Raises SyncerError if that cannot be done within `timeout` seconds (None: as long as the
        transfers make progress); work is never dropped silently. In an island every rank calls it."""
        if self._finished:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        applies = self._lead(self._await_results, deadline) or []
        if self.island:
            applies = self._share(applies)
        for p, local in applies:
            self._apply(p, local)
        flush = self._lead(lambda: [s.fragment.index for s in self.slots if s.steps and s.pushed_at is None]) or []
        if self.sharded:
            flush = self._share(flush)
        for p in flush:
            self._push(p, finishing=True)
            self.flushed += self.leader
        self._finished = True
        try:
            self._lead(self._leave, deadline)
        finally:
            self._release_switch()
        if self.island:
            self._share(None)

    def _await_results(self, deadline: float | None) -> list[tuple[int, bool]]:
        wait_until = time.monotonic() + RESULT_WAIT if deadline is None else min(deadline, time.monotonic() + RESULT_WAIT)
        while any(s.pushed_at is not None and s.ready is None for s in self.slots) and time.monotonic() < wait_until:
            self._collect(block=True, timeout=0.2)
        self._collect(block=False)
        return [(s.fragment.index, self._reads_local(s)) for s in self.slots if s.ready is not None]

    def _leave(self, deadline: float | None) -> None:
        self._report(None, time.monotonic())
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self.transport.close(timeout=remaining)
        except SyncerError as e:
            self._error = str(e)
            if self.island is None:
                raise

    def close(self) -> None:
        """Leave without pushing what is left (e.g. on error)."""
        self._finished = True
        self._release_switch()
        if self.leader and self.transport is not None:
            try:
                self.transport.close(timeout=5.0)
            except SyncerError as e:
                log.warning("learner %s left with work undelivered: %s", self.learner_id, e)

    def global_fragment_versions(self) -> list[int]:
        return [s.version for s in self.slots]


__all__ = ["Learner", "SyncerError"]
