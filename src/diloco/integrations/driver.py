"""One learner's life inside a framework's training loop, free of any framework: joined at train begin (the model
takes the global values), told the tokens of each optimizer step, asked whether the run's budget is spent, and
finished at train end. The framework callbacks only translate their hooks into these calls."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from diloco.integrations import lines, rejoin
from diloco.integrations.budget_lr import Schedule, follow_budget
from diloco.integrations import tokens
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError

BUDGET_WAIT_MARGIN = 2.0
"""Seconds a learner with an lr_schedule waits at join, beyond the first heartbeat's period and deadline, for the
syncer's first word on its budget."""


def island_group():
    """The process group of a torchrun job of several ranks (one learner, an island); None for a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class LearnerDriver:
    """Settings shared by the callbacks; see `diloco.integrations.transformers.DiLoCoCallback` for each one."""

    def __init__(self, syncer: str, learner_id: str, token: str = "", *, connect_timeout: float = 30.0,
                 lr_schedule: Schedule | None = None, count_tokens: Callable[[object], int] | None = None,
                 finish_timeout: float | None = 300.0, transport_options: dict | None = None,
                 learner_options: dict | None = None):
        if not isinstance(syncer, str) or not syncer.strip():
            raise ValueError(f"syncer must be the syncer's address, 'host:port' (or 'A:port,B:port' for a sharded "
                             f"syncer), got {syncer!r}")
        if not isinstance(learner_id, str) or not learner_id:
            raise ValueError(f"learner_id must be a stable name for this learner (it rejoins under it), got "
                             f"{learner_id!r}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0 seconds, got {connect_timeout}")
        if lr_schedule is not None and not callable(lr_schedule):
            raise ValueError(f"lr_schedule must be a function of the budget progress (0..1) giving a factor on the "
                             f"learning rate, e.g. diloco.integrations.budget_lr.decay_tail(), got {lr_schedule!r}")
        self.syncer = syncer
        self.learner_id = learner_id
        self.token = token
        self.connect_timeout = connect_timeout
        self.lr_schedule = lr_schedule
        self.count_tokens = count_tokens or tokens.count_tokens
        self.finish_timeout = finish_timeout
        self.transport_options = dict(transport_options or {})
        self.learner_options = dict(learner_options or {})
        self.learner: Learner | None = None
        self._joined = False
        """Whether `learner` is in the run (joined, neither finished nor closed)."""
        self.pending_tokens = 0
        """Tokens of the micro-batches since the last optimizer step."""
        self._after_step: Callable[[], None] = lambda: None
        self.resumed: rejoin.RejoinRecord | None = None
        """The record of the checkpoint the last join resumed from."""
        self.ledger_position = 0
        """Where the syncer's ledger said this learner's merged work ended, at the last join."""
        self._stopping = False
        """Whether the run's budget was heard spent (and said so) since the last join."""

    # ---- joining ------------------------------------------------------------------------------------------
    def transport(self):
        from diloco.learner.grpc_transport import GrpcTransport
        from diloco.learner.sharded import ShardedTransport

        options = dict(token=self.token, connect_timeout=self.connect_timeout, **self.transport_options)
        addresses = [a.strip() for a in self.syncer.split(",") if a.strip()]
        return GrpcTransport(addresses[0], **options) if len(addresses) == 1 else ShardedTransport(addresses, **options)

    def join(self, model: nn.Module, *, resumed: rejoin.RejoinRecord | None = None, source: str = "",
             process_group=None, optimizer: torch.optim.Optimizer | None = None, scheduler=None) -> Learner:
        """Join the run (the model's values become the global model's). `resumed`: the record of the checkpoint the
        framework resumed from (`source` names it); `process_group`: the ranks of an island (rank 0 talks)."""
        if resumed is not None:
            rejoin.check_id(resumed, self.learner_id, source)
        if self.lr_schedule is not None and optimizer is None:
            raise ValueError("lr_schedule needs the optimizer, and the framework gave none at train begin")
        self.close()  # a learner left over from a train() that raised: it leaves before this one joins
        self.pending_tokens, self._stopping = 0, False
        leader = process_group is None or _rank(process_group) == 0
        learner = Learner(model, self.transport() if leader else None, self.learner_id, process_group=process_group,
                          **self.learner_options)
        self.learner, self._joined = learner, True
        self.resumed, self.ledger_position = resumed, learner.data_position
        try:
            if resumed is not None and leader:
                for note in rejoin.compare(resumed, learner.data_position, self.versions(), source):
                    lines.logger().warning("learner %s: %s", self.learner_id, note)
            if self.lr_schedule is not None:
                self._await_budget(learner)
                self._after_step = follow_budget(optimizer, scheduler, self.lr_schedule,
                                                 lambda: learner.budget_progress)
        except BaseException:
            self.close()
            raise
        if leader:
            lines.logger().info("learner %s joined the run at %s (H=%d, %d fragments, %s)%s", self.learner_id,
                                self.syncer, learner.config.sync_every, learner.config.fragments,
                                learner.config.codec, f", resumed from step {resumed.data_position} ({source})"
                                if resumed is not None else "")
        return learner

    def _await_budget(self, learner: Learner) -> None:
        """An lr_schedule follows the run's budget: a syncer without one is a contradiction to report now, not a
        learning rate that silently never decays."""
        known = None
        if learner.leader:
            beat = learner.config.heartbeat_seconds  # the first heartbeat leaves after one period; its deadline:
            deadline = time.monotonic() + beat + max(2.0, 4 * beat) + BUDGET_WAIT_MARGIN
            while (known := learner.transport.budget_progress) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if learner.island is not None:
            known = learner.island.share(known)
        if known is None:
            raise ValueError(f"lr_schedule follows the run's budget, but the syncer at {self.syncer} has none: start "
                             f"it with --tokens or --duration, or drop lr_schedule")

    # ---- training -----------------------------------------------------------------------------------------
    def add(self, batch) -> None:
        """Count one micro-batch of the coming optimizer step."""
        self.pending_tokens += int(self.count_tokens(batch))

    def step(self, data_position: int, loss: float | None = None) -> bool:
        """One optimizer step is done; returns whether the run's budget is spent."""
        if not self._joined:
            raise RuntimeError("the learner is not in the run: it joins in the framework's train-begin hook and "
                               "leaves at train end")
        counted, self.pending_tokens = self.pending_tokens, 0
        if counted <= 0:
            raise ValueError(f"counted no tokens in optimizer step {data_position}: the batches hold no "
                             f"attention_mask, labels or input_ids; pass count_tokens=... (batch -> tokens)")
        self.learner.step(counted, loss=loss, data_position=data_position)
        self._after_step()
        if self.learner.should_stop and not self._stopping:
            self._stopping = True
            if self.learner.leader:
                lines.logger().info("learner %s: the run's budget is spent: stopping the training after step %d",
                                    self.learner_id, data_position)
        return self.learner.should_stop

    # ---- checkpoints and leaving --------------------------------------------------------------------------
    def versions(self) -> dict[int, int]:
        return {s.fragment.index: s.version for s in self.learner.slots} if self.learner is not None else {}

    def record(self, data_position: int) -> rejoin.RejoinRecord:
        tokens = self.learner.tokens if self.learner is not None else 0
        return rejoin.RejoinRecord(self.learner_id, data_position, tokens, self.versions())

    @property
    def joined(self) -> bool:
        return self._joined

    def finish(self) -> None:
        """Push what is left and leave the run (every rank of an island calls it)."""
        if self._joined:
            self._joined = False
            self.learner.finish(timeout=self.finish_timeout)
            if self.learner.leader:
                lines.logger().info("learner %s left the run after %d steps, %d pushes", self.learner_id,
                                    self.learner.step_count, self.learner.pushes)

    def close(self) -> None:
        """Leave without pushing what is left."""
        if self._joined:
            self._joined = False
            self.learner.close()
            if self.learner.leader:
                lines.logger().info("learner %s left the run after %d steps, without pushing its last ones",
                                    self.learner_id, self.learner.step_count)


def _rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


__all__ = ["LearnerDriver", "SyncerError", "island_group"]
