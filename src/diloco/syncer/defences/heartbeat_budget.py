"""How many heartbeats the syncer answers: per credential, all its ids together, and in total.

Each credential (a learner's own, a client certificate's, or, under a shared run token, each id) has a token bucket
of PER_CREDENTIAL a second, holding as many. Once more than TOTAL / PER_CREDENTIAL credentials are active, each
gets an equal share of TOTAL instead, but never less than FLOOR: a flood, from one party's many ids or from many
parties, is refused beyond its share, and an honest learner (2 heartbeats a second) always gets its own.
"""

from __future__ import annotations

import time

PER_CREDENTIAL = 100.0
"""Heartbeats a second one credential may send, over all its ids (a learner sends 2 a second, 20 with
heartbeat_seconds 0.05), with a burst of as many."""
TOTAL = 1000.0
"""Heartbeats a second over all credentials, shared equally by those active once that is less than PER_CREDENTIAL
each. Each answered heartbeat takes the core's lock: 1,320 a second (one party's 20 ids, each within a per-id
limit) slowed an honest learner from 58 to 41 steps a second."""
FLOOR = 20.0
"""A credential's share never goes below this: with more than TOTAL / FLOOR active credentials the total is
FLOOR each."""
ACTIVE_SECONDS = 5.0
"""A credential heard within this counts as active (and its bucket is kept)."""


class HeartbeatBudget:
    """Token buckets per credential with a share of a total. Event loop only (not thread-safe)."""

    def __init__(self, per_credential: float = PER_CREDENTIAL, total: float = TOTAL, floor: float = FLOOR,
                 clock=time.monotonic):
        self.per_credential, self.total, self.floor, self.clock = per_credential, total, floor, clock
        self._buckets: dict[str, tuple[float, float]] = {}
        """Per credential: (heartbeats it may still send at once, when that was reckoned)."""
        self._pruned_at = clock()

    def rate(self) -> float:
        """Heartbeats a second each active credential may send now."""
        active = max(1, len(self._buckets))
        return min(self.per_credential, max(self.floor, self.total / active))

    def allow(self, credential: str) -> bool:
        """Whether a heartbeat of `credential` is answered now (counted if so)."""
        now = self.clock()
        if now - self._pruned_at > 1.0:
            self._prune(now)
        rate = self.rate()
        left, at = self._buckets.get(credential, (rate, now))
        left = min(rate, left + (now - at) * rate)
        allowed = left >= 1.0
        self._buckets[credential] = (left - 1.0 if allowed else left, now)
        return allowed

    def _prune(self, now: float) -> None:
        # a bucket untouched for ACTIVE_SECONDS is full again: forgetting it changes nothing but the active count
        self._buckets = {c: b for c, b in self._buckets.items() if now - b[1] <= ACTIVE_SECONDS}
        self._pruned_at = now
