"""The syncer's view of its learners: liveness, departures, who pushes, and the token and time budget.

Mixed into SyncerCore (syncer/core.py), whose state it reads: `learners`, `lock`, `clock`, `cfg`, the budgets.
Every method here may run on any thread (core.py's docstring: Threading), under `lock`.
"""

from __future__ import annotations

import logging

from diloco import ids
from diloco.algorithm.policy import Averages
from diloco.syncer.ledger import LearnerRecord
from diloco.syncer.revocation import revoked_message

log = logging.getLogger("diloco.syncer")

DEPARTED_KEPT = 4096
"""Records of learners that left or are absent kept at most (oldest forgotten first): ids cost memory."""


class Refused(Exception):
    """A request the syncer will not honour; the message says why and what to do."""


def check_learner_id(learner_id: str) -> str:
    """`learner_id`, or Refused saying what an id may hold."""
    try:
        return ids.check_learner_id(learner_id)
    except ids.InvalidLearnerId as e:
        raise Refused(str(e)) from None


def rejoined(record: LearnerRecord, now: float, absent_after: float) -> str:
    """How a known learner came to start a new session, for its join's log line."""
    if not record.session:  # a restored record: the saved ledger holds no session secret
        return "after the syncer restarted"
    if record.left:
        return "after leaving" + (f" {now - record.left_at:.0f} s ago" if record.left_at is not None else "")
    if record.absent or now - record.last_seen > absent_after:
        return f"after {now - record.last_seen:.0f} s absent"
    return "while its earlier session was live (a restarted process): that session ends"


class Membership:
    def _record(self, learner_id: str, session: str) -> LearnerRecord:
        record = self.learners.get(learner_id)
        if record is None or not record.check_session(session):
            raise Refused(f"unknown learner or wrong session for learner {learner_id!r}: it left, re-joined "
                          f"elsewhere or never joined; join again")
        if record.revoked:
            raise Refused(revoked_message(learner_id))
        return record

    def heartbeat(self, learner_id: str, session: str, **progress) -> bool:
        """Record liveness and progress; returns True when the learner should stop (budget reached). Any thread."""
        with self.lock:
            self._note_progress(learner_id, session, progress)
            return self.should_stop()

    def _note_progress(self, learner_id: str, session: str, progress: dict) -> None:
        """A heartbeat's liveness and counters into its learner's record (the lock held)."""
        record = self._record(learner_id, session)
        self._heard(record)
        if self.training_started_at is None and (progress.get("tokens_trained") or 0) > 0:
            self.training_started_at = record.last_seen  # a duration counts training, not start-up
        progress.pop("data_position", None)  # the ledger's position moves only when work is merged
        if progress.get("tokens_trained") is not None:  # the session's count, on its earlier sessions'
            progress["tokens_trained"] += record.tokens_base
        if progress.get("step") is not None:
            progress["step"] += record.steps_base
        step_seconds = progress.pop("step_seconds", None)
        if step_seconds:
            record.step_time.update(step_seconds)
        for key, value in progress.items():
            if value is not None:
                setattr(record, key, value)

    def _heard(self, record: LearnerRecord) -> None:
        """The learner was heard from in its current session (the lock held): back, if it was absent."""
        now = self.clock()
        if record.absent:
            record.absent = False
            log.info("learner %s is back after %.0f s absent (same session)", record.id, now - record.last_seen)
        record.last_seen = now

    def note_absences(self) -> list[str]:
        """Mark learners not heard from for absent_after_seconds as absent, one log line each; returns their ids.
        Nothing changes for them but the line: `live` already leaves them out."""
        with self.lock:
            now, after = self.clock(), self.cfg.absent_after_seconds
            gone = [r for r in self.learners.values() if not r.left and not r.absent and now - r.last_seen > after]
            for r in gone:
                r.absent = True
        for r in gone:
            log.warning("learner %s is absent: not heard from for %.0f s (absent after %g s); it may come back or "
                        "rejoin under its id", r.id, now - r.last_seen, after)
        return [r.id for r in gone]

    def heartbeat_reply(self, learner_id: str, session: str, **progress) -> tuple[bool, float | None, int, float | None]:
        """`heartbeat`, then what its reply carries: (stop, phase lead, tokens trained, budget progress), read
        together under the lock. Any thread: never waits for a merge."""
        with self.lock:  # the budget counted once: every heartbeat of every learner asks for it
            self._note_progress(learner_id, session, progress)
            tokens = self.budget_tokens()
            share = self.budget_progress(tokens)
            stop = self.stopping or (share is not None and share >= 1.0)
            return stop, self.phase_lead(learner_id), tokens, share

    def should_stop(self) -> bool:
        if self.stopping:
            return True
        with self.lock:
            progress = self.budget_progress()
        return progress is not None and progress >= 1.0

    def budget_progress(self, tokens: int | None = None) -> float | None:
        """Share of the token or time budget spent (the larger when both are set); None without a budget.
        `tokens`: `budget_tokens()` when the caller has just counted it (under the lock)."""
        shares = []
        if self.token_budget:
            with self.lock:
                shares.append((self.budget_tokens() if tokens is None else tokens) / self.token_budget)
        if self.duration and self.training_started_at is not None:
            shares.append((self.clock() - self.training_started_at) / self.duration)
        return min(max(shares), 1.0) if shares else None

    def expire(self) -> list[str]:
        """Forget learners that left or have been absent for forget_after_seconds, and the oldest departed ones
        beyond DEPARTED_KEPT; returns their ids. Learners with a contribution in an open round are kept."""
        with self.lock:
            now = self.clock()
            busy = {learner for fs in self.fragments for learner in fs.pending}
            departed = sorted((r for r in self.learners.values() if r.id not in busy and (
                r.left or now - r.last_seen > self.cfg.absent_after_seconds)), key=lambda r: r.last_seen)
            excess = max(0, len(departed) - DEPARTED_KEPT)
            gone = [r.id for i, r in enumerate(departed)
                    if i < excess or now - r.last_seen > self.cfg.forget_after_seconds]
            for learner_id in gone:  # what they trained and got merged still counts, in the budget too
                r = self.learners.pop(learner_id)
                self.departed["trained"] += r.tokens_trained
                self.departed["budget"] += self._budget_tokens(r)
                self.departed["merged"] += r.tokens_merged
        if gone:
            self.record_event("forgotten", learners=gone)
            self.persist([])
        return gone

    def leave(self, learner_id: str, session: str) -> None:
        with self.lock:
            record = self._record(learner_id, session)
            record.left, record.left_at = True, self.clock()
            self.record_event("leave", learner=learner_id)
        log.info("learner %s left the run (step %d, %d tokens trained)", learner_id, record.step,
                 record.tokens_trained)

    def refused_join(self, learner_id: str, reason: str) -> None:
        """Count a refused join in `refusals` by its reason, as refused pushes are, and put it on the tape."""
        with self.lock:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
        self.record_event("refusal", learner=learner_id, rpc="join", reason=reason)

    def live(self) -> frozenset[str]:
        with self.lock:
            now = self.clock()
            return frozenset(
                r.id for r in self.learners.values() if not r.left and now - r.last_seen <= self.cfg.absent_after_seconds
            )

    def tokens_trained(self) -> int:
        """Tokens learners' heartbeats report, forgotten learners' included: claims, which /status shows as
        `tokens_claimed` (its `tokens_trained` is `budget_tokens`, what accepted pushes back)."""
        with self.lock:
            return self.departed["trained"] + sum(r.tokens_trained for r in self.learners.values())

    def budget_tokens(self) -> int:
        """Tokens the budget and the learning-rate progress count: per learner what its heartbeats report, but never
        more than its accepted pushes carried, or the claims they vouched for (`LearnerRecord.tokens_backed`), plus
        two cycles (2·H steps) at its accepted tokens per step (what it trained since its latest pushes). A claim
        in a heartbeat alone spends nothing. Forgotten learners' count as when they were forgotten."""
        with self.lock:
            return int(self.departed["budget"] + sum(self._budget_tokens(r) for r in self.learners.values()))

    def _budget_tokens(self, r: LearnerRecord) -> float:
        backed = max(r.tokens_accepted, r.tokens_backed)
        return min(r.tokens_trained, backed + 2 * self.cfg.sync_every * r.step_tokens)

    def pushing(self, learners) -> frozenset[str]:
        """Those of `learners` that push: a push accepted in their current session within two cycles (H of their
        step times) or the absence timeout, whichever is longer, or joined within the absence timeout (their first
        push is on its way). An id that only heartbeats holds no round and counts in no round's share."""
        with self.lock:
            now, H = self.clock(), self.cfg.sync_every

            def pushes(r: LearnerRecord) -> bool:
                if r.last_push is None or r.last_push[0] < r.joined_at:
                    return now - r.joined_at <= self.cfg.absent_after_seconds
                return now - r.last_push[0] <= max(self.cfg.absent_after_seconds, 2 * H * (r.step_time.value or 0.0))

            return frozenset(i for i in learners if pushes(self.learners[i]))

    def tokens_merged(self) -> int:
        with self.lock:
            return self.departed["merged"] + sum(r.tokens_merged for r in self.learners.values())

    def averages(self) -> Averages:
        with self.lock:
            live = self.live()
            steps = [r.step_time.value for r in self.learners.values() if r.id in live and r.step_time.value]
            # the fastest learner pushes first and waits longest, so its step time bounds the window
            return Averages(min(steps) if steps else None, self.quorum_avg.value, self.sync_avg.value)
