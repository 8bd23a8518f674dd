"""The Learner: wraps a user's model and inner optimizer and does everything DiLoCo needs between steps.

The user's loop stays as it is and calls `learner.step(tokens)` after each optimizer step. On the training
thread this only copies fragments to and from CPU buffers; encoding, sending and receiving run in the
transport's background threads (DESIGN §3.3, §4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from diloco.config import SyncConfig
from diloco.fragments import Fragment, gather, plan_fragments, scatter, tensor_specs
from diloco.learner.transport import Arrival, PushJob, SyncerError, Transport
from diloco.schedule import due

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
    pushed: tuple[torch.Tensor, int, int] | None = None
    """(local values, steps, tokens) at the push, for keeping the overlapped progress on apply."""


class Learner:
    """One learner of a run.

    Args:
        model: the replica to train; its parameters are replaced by the global model on join.
        transport: how to reach the syncer (`GrpcTransport("host:port")` or an in-process one).
        learner_id: a stable name; re-joining under the same id resumes this learner's ledger.
        embedding_names: parameter names to merge as embeddings (default: every nn.Embedding weight).
        speed: the speed factor reported to the syncer (only informational).
    """

    def __init__(self, model: nn.Module, transport: Transport, learner_id: str, *,
                 embedding_names: set[str] | None = None, speed: float | None = None):
        self.model = model
        self.transport = transport
        self.learner_id = learner_id
        self.params = dict(model.named_parameters())
        specs = tensor_specs(model, embedding_names)
        self.info = transport.join(learner_id, specs, self._initial_fragments(specs))
        self.config: SyncConfig = self.info.config
        self.layout = plan_fragments(specs, self.config.fragments)
        self.slots = [FragmentSlot(self.layout[i], values.clone(), version) for i, version, values in self.info.fragments]
        for slot in self.slots:
            scatter(slot.base, self.params, slot.fragment)
        self.step_count = 0
        self.tokens = 0
        self.data_position = self.info.data_position
        self.pushes = self.applied = self.skipped = self.refused = self.flushed = self.realigned = 0
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
        self.speed = speed

    def _initial_fragments(self, specs):
        def initial(num_fragments: int) -> list[torch.Tensor]:
            return [gather(self.params, f) for f in plan_fragments(specs, num_fragments)]

        return initial

    @property
    def should_stop(self) -> bool:
        """True once the syncer says the run's budget is spent."""
        return self.transport.stop_requested

    @property
    def budget_progress(self) -> float | None:
        """Share of the run's budget (tokens or duration) spent, as the syncer last said; None if it has none.
        Drive a learning-rate decay with it so that every learner decays together."""
        return self.transport.budget_progress

    @property
    def schedule_position(self) -> int:
        """This learner's position in the push schedule: its step count plus the shifts that keep it in phase
        with its peers. Every position up to it has been passed exactly once."""
        return self.step_count + self._shift

    def step(self, tokens: int, loss: float | None = None, data_position: int | None = None) -> None:
        """Call after every inner optimizer step with the tokens that step consumed."""
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_seconds = now - self._last_step_at
            self._tokens_per_second = tokens / max(self._step_seconds, 1e-9)
        self._last_step_at = now
        self.step_count += 1
        self.tokens += tokens
        if data_position is not None:
            self.data_position = data_position
        for slot in self.slots:
            slot.steps += 1
            slot.tokens += tokens
        for p in self._due():
            self._push(self.slots[p])
        self._collect(block=False)
        for slot in self.slots:
            self._maybe_apply(slot)
        if now - self._last_report >= self.config.heartbeat_seconds / 2:
            self._report(loss, now)

    def _due(self) -> list[int]:
        """Fragments to push now: those due at this learner's position in the schedule (its step plus a shift that
        keeps it in phase with its peers, DESIGN §3.2)."""
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

    def _push(self, slot: FragmentSlot) -> None:
        if slot.pushed_at is not None:
            self.skipped += 1  # the last push's result is still out; its Δ already covers this progress
            return
        local = gather(self.params, slot.fragment)
        delta = slot.base - local
        if self.config.keep_overlap:
            slot.pushed = (local, slot.steps, slot.tokens)
        self._seq += 1
        self.transport.push(PushJob(slot.fragment.index, delta, slot.version, slot.steps, slot.tokens, self._seq,
                                    self.data_position))
        slot.pushed_at, slot.pushed_seq = self.step_count, self._seq
        self.pushes += 1

    def _collect(self, block: bool, timeout: float | None = None) -> None:
        for arrival in self.transport.arrivals(timeout if block else None):
            slot = self.slots[arrival.fragment]
            if slot.pushed_at is None or arrival.seq != slot.pushed_seq:
                continue  # an answer to an earlier (re-sent) push: applying it would count progress twice
            if arrival.refused:
                self.refused += 1
            slot.ready = arrival

    def _maybe_apply(self, slot: FragmentSlot) -> None:
        if slot.pushed_at is None or self.step_count < slot.pushed_at + self.config.overlap:
            return
        while slot.ready is None and self.config.wait_for_merge:
            self._collect(block=True, timeout=1.0)
            if self.transport.stop_requested and slot.ready is None:
                return
        if slot.ready is None:
            return  # decoupled: keep training, apply when it arrives
        self._apply(slot, slot.ready)

    def _apply(self, slot: FragmentSlot, arrival: Arrival) -> None:
        values, steps, tokens = arrival.values, 0, 0
        if self.config.keep_overlap and slot.pushed is not None and not arrival.refused:
            local, pushed_steps, pushed_tokens = slot.pushed
            values = values + (gather(self.params, slot.fragment) - local)  # steps taken since the push stay
            steps, tokens = slot.steps - pushed_steps, slot.tokens - pushed_tokens
        elif self.config.blend:
            values = self.config.blend * gather(self.params, slot.fragment) + (1 - self.config.blend) * values
        scatter(values, self.params, slot.fragment)
        slot.base, slot.version = arrival.values, arrival.version
        slot.steps, slot.tokens, slot.pushed = steps, tokens, None
        slot.pushed_at, slot.ready = None, None
        self.applied += 1

    def _report(self, loss: float | None, now: float) -> None:
        self._last_report = now
        self.transport.report(
            step=self.step_count, tokens_trained=self.tokens, loss=loss, data_position=self.data_position,
            step_seconds=self._step_seconds, pushes=self.pushes, applied=self.applied, speed=self.speed,
            tokens_per_second=self._tokens_per_second,
        )

    def finish(self, timeout: float = 30.0) -> None:
        """End of training: wait for results still out, push all remaining progress, leave the run."""
        deadline = time.monotonic() + timeout
        while any(s.pushed_at is not None for s in self.slots) and time.monotonic() < deadline:
            self._collect(block=True, timeout=0.2)
            for slot in self.slots:
                if slot.ready is not None:
                    self._apply(slot, slot.ready)
        for slot in self.slots:
            if slot.steps and slot.pushed_at is None:
                self._push(slot)
                self.flushed += 1
        self._report(None, time.monotonic())
        self.transport.close()

    def close(self) -> None:
        """Leave without pushing what is left (e.g. on error)."""
        self.transport.close()

    def global_fragment_versions(self) -> list[int]:
        return [s.version for s in self.slots]


__all__ = ["Learner", "SyncerError"]
