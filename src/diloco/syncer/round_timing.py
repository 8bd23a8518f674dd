"""When the syncer's rounds close: the policy asked about every open round (docs/algorithm.md §4), as of the time a close
became due, so that a late wake-up never changes a round's contributors; the tape records what it was asked.

Mixed into SyncerCore (syncer/core.py), whose state it reads: `fragments`, `learners`, `lock`, `clock`, `cfg`,
the moving averages and the outbox. `poll` and `_close_if_due` run on the worker thread (core.py: Threading).
"""

from __future__ import annotations

from diloco.algorithm.policy import Averages, Decision, RoundState, decide
from diloco.syncer import phase, rounds
from diloco.syncer.downlink import Publication
from diloco.syncer.fragment_state import FragmentState


class RoundTiming:
    def awaited(self, fs: FragmentState, live: frozenset[str]) -> frozenset[str]:
        """The live learners a round of `fs` waits for. In a synchronous mode, not those that joined after its first
        push arrived: they start their schedules after that fragment (`_start_position`) and will not push it
        until its next turn, while their peers block on its merge."""
        if not self.cfg.wait_for_merge:
            return self.pushing(live) | (live & frozenset(fs.pending))
        if fs.opened_at is None:
            return live
        return frozenset(i for i in live if self.learners[i].joined_at <= fs.opened_at or i in fs.pending)

    def poll(self, force: bool = False) -> list[Publication]:
        """Close every round the policy (or `force`, at shutdown) allows; returns what to send to whom. Worker
        thread: the rounds are chosen under the lock and closed without it. A round closes as it was when the policy
        had it due (`_due`): a wake-up that comes late delays the close but never changes its contributors, since a
        push that arrives after that is let in only once the round is closed (`_close_if_due`)."""
        closing = []
        with self.lock:
            out, self._outbox = self._outbox, []
            live, avg, now = self.live(), self.averages(), self.clock()
            for index, fs in enumerate(self.fragments):
                if not fs.pending:
                    continue
                d, _, inputs = self._ask(index, fs, live, avg, now, now)
                if d.close or force:
                    forced = {**inputs, "reason": "forced", "due": inputs["now"]}
                    closing.append((index, fs, inputs if d.close else forced))
        for index, fs, inputs in closing:
            out.extend(rounds.close(self, index, fs, inputs))
        return out

    def _close_if_due(self, index: int, fs: FragmentState, at: float) -> tuple[int, dict] | None:
        """Before a push that arrived at `at` joins fragment `index`'s open round: close the round first when the
        policy had it due before `at`, so that a wake-up that comes late (a busy machine) never lets a push into a
        round the policy had closed. Returns (the round's version, what the policy decided on when it let the push
        in) for the tape (`rounds.checked`); None when no round was open or it was closed."""
        with self.lock:
            if not fs.pending:
                return None
            d, due, inputs = self._ask(index, fs, self.live(), self.averages(), at, self.clock())
            if not d.close or due >= at:  # a close due at the push's own arrival time takes the push in
                asked = {k: inputs[k] for k in ("live", "averages", "expected")}
                return fs.version, {"present": len(fs.pending), **asked}
        self._outbox.extend(rounds.close(self, index, fs, inputs))
        return None

    def _ask(self, index: int, fs: FragmentState, live: frozenset[str], avg: Averages, at: float,
             now: float) -> tuple[Decision, float | None, dict]:
        """(Lock held.) The policy's decision on fragment `index`'s open round as of `at` (≤ `now`, the clock), when
        a close became due (`_due`; None while it waits), and what it decided on as the tape records it
        (syncer/replay.py): the reason, when the syncer acted (`now`) and when the close was due (`due`), the open and
        quorum times, the learners it awaited, the moving averages and the predicted pushes. Notes the quorum when
        first reached."""
        quorum_before = fs.quorum_at
        d, expected = self._decide(index, fs, live, avg, at)
        self._note_quorum(fs, d, expected, avg)
        due = self._due(fs, d, live, at, now) if d.close else None
        t = lambda x: None if x is None else round(x - self.started_at, 6)  # noqa: E731
        return d, due, {"reason": d.reason, "now": t(now), "due": t(due), "opened_at": t(fs.opened_at),
                        "quorum_at": t(quorum_before), "live": sorted(self.awaited(fs, live)), "averages": vars(avg),
                        "expected": {k: t(v) for k, v in expected.items()}, "at_quorum": fs.at_quorum}

    def _note_quorum(self, fs: FragmentState, d: Decision, expected: dict[str, float], avg: Averages) -> None:
        """(Lock held.) Store when the round reached quorum, if `d` says it has and it was not yet stored."""
        if d.quorum_at is not None and fs.quorum_at is None:
            fs.quorum_at = d.quorum_at
            self.quorum_avg.update(d.quorum_at - fs.opened_at)
            # the inputs its grace window was first set from, before later contributors left `expected`
            t = lambda x: round(x - self.started_at, 6)  # noqa: E731
            fs.at_quorum = {"averages": vars(avg), "expected": {k: t(v) for k, v in expected.items()}}

    def _due(self, fs: FragmentState, d: Decision, live: frozenset[str], at: float, now: float) -> float:
        """(Lock held.) When the close `d` of `fs`'s round, decided as of `at` with the live learners `live` of `now`,
        became due: at its deadline, but never before the latest push in the round (each was let in because the
        round was not due when it arrived); a close that holds whenever its inputs do (every live learner
        contributed), when they came to: that latest push, or a learner's leaving or turning absent after it."""
        since = max((c.arrived_at for c in fs.pending.values() if c.arrived_at is not None), default=at)
        if d.due_at is not None:
            return max(d.due_at, since)
        gone = [r.left_at if r.left else r.last_seen + self.cfg.absent_after_seconds
                for r in self.learners.values() if r.id not in live and r.id not in fs.pending]
        return max([since, *(x for x in gone if x is not None and since < x <= now)])

    def next_wakeup(self) -> float | None:
        """When `poll` may have something new to do without any new request."""
        with self.lock:
            return self._next_wakeup()

    def _next_wakeup(self) -> float | None:
        live, avg, now = self.live(), self.averages(), self.clock()
        times = [now] if self._outbox else []
        for index, fs in enumerate(self.fragments):
            if fs.pending:
                d, _ = self._decide(index, fs, live, avg, now)
                times.append(now if d.close else d.wake_at)
        # a learner turning absent can unblock a round that waits for everyone
        times += [self.learners[i].last_seen + self.cfg.absent_after_seconds for i in live]
        times = [t for t in times if t is not None]
        return min(times) if times else None

    def _decide(self, index: int, fs: FragmentState, live: frozenset[str], avg: Averages, now: float):
        """The policy's decision for a fragment's open round, and the predicted pushes it was given."""
        live = self.awaited(fs, live)
        state = RoundState(frozenset(fs.pending), fs.opened_at, fs.quorum_at)
        policy, expected = self.policy, {}
        if policy.expect_steps:
            expected = {i: at for i in live - state.contributors
                        if (at := phase.predicted_push(self.learners[i], index, now, self.cfg.sync_every,
                                                       self.cfg.fragments)) is not None}
        return decide(state, live, avg, now, policy, expected), expected
