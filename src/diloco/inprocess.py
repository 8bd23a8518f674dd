"""The in-process transport: learners (threads) calling a SyncerCore directly — exact and deterministic, for tests,
examples and simulations. It joins the learner's side to the syncer's, so it lives apart from both."""

from __future__ import annotations

import threading

from diloco.algorithm import codec
from diloco.learner.transport import HeartbeatNews, JoinInfo, PushJob, Receiver, SyncerError
from diloco.syncer.core import Refused, SyncerCore
from diloco.syncer.downlink import Publication


class LocalSyncer:
    """A SyncerCore shared by learners in one process (threads), with a lock and per-learner receivers."""

    def __init__(self, core: SyncerCore):
        self.core = core
        self.lock = threading.Lock()
        self.receivers: dict[str, Receiver] = {}

    def deliver(self, publications: list[Publication]) -> None:
        for pub in publications:
            self.receivers[pub.learner].accept(pub)

    def tick(self) -> None:
        with self.lock:
            self.deliver(self.core.poll())


class LocalTransport(HeartbeatNews):
    """In-process transport: every call goes straight to the shared core; nothing is encoded twice."""

    def __init__(self, local: LocalSyncer):
        self.local = local
        self._feedback = codec.ErrorFeedback()
        self.learner_id = ""
        self.session = ""
        self._stop = False

    def join(self, learner_id, specs, initial):
        self.learner_id = learner_id
        with self.local.lock:
            core = self.local.core
            try:
                if not core.initialized:
                    core.initialize(specs, initial(core.cfg.fragments, core.cfg.split_tensors))
                self.session = core.join(learner_id, specs)
            except Refused as e:
                raise SyncerError(str(e)) from None
            receiver = self.local.receivers.setdefault(learner_id, Receiver())
            fragments = core.snapshot_for_join(learner_id)  # copies already
            receiver.reset(fragments, keep_overlap=core.cfg.keep_overlap)
            record = core.learners[learner_id]
            return JoinInfo(core.cfg, self.session, fragments, record.data_position, record.start_position)

    @property
    def receiver(self) -> Receiver | None:
        """This learner's receiver; None before it joined."""
        return self.local.receivers.get(self.learner_id)

    def push(self, job: PushJob) -> None:
        cfg = self.local.core.cfg
        payload = job.payload(cfg.codec, self._feedback if cfg.error_feedback else None)
        with self.local.lock:
            core = self.local.core
            result = core.push(self.learner_id, self.session, job.seq, job.fragment, job.base_version, job.steps,
                               job.tokens, payload, job.data_position, final=job.final)
            if not result.accepted and result.resync:
                self.local.receivers[self.learner_id].accept(core.resync(self.learner_id, self.session, job.fragment, job.seq),
                                                             "" if result.accepted else result.reason)
            self.local.deliver(core.poll())

    def arrivals(self, timeout=None):
        return self.local.receivers[self.learner_id].drain(timeout)

    def report(self, **progress):
        with self.local.lock:
            self._stop = self.local.core.heartbeat(self.learner_id, self.session, **progress)
            self._budget_progress = self.local.core.budget_progress()
            self._phase_lead = self.local.core.phase_lead(self.learner_id)

    @property
    def stop_requested(self) -> bool:
        return self._stop

    @property
    def wire_bytes(self) -> int:
        return 0

    def close(self, timeout: float | None = None) -> None:
        with self.local.lock:  # pushes were delivered as they were made
            self.local.core.leave(self.learner_id, self.session)
            self.local.deliver(self.local.core.poll())
