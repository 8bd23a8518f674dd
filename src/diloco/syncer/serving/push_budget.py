"""Bytes of push payloads the syncer holds at once, whatever the number of learners.

A push's payload lives on the syncer from its first data chunk until the core worker has folded it into the round's
sum. With many learners pushing while the worker merges, those payloads pile up: one per learner, the largest
fragment's int4 size each. The budget bounds them: a push whose header has arrived waits here before its data is
read, and gRPC's flow control holds the rest on the learner's side, so a push beyond the budget waits, never fails
(a learner whose push waits longer than its stall timeout sends it again). A push larger than the whole budget
runs alone."""

from __future__ import annotations

import asyncio


class PushBudget:
    """At most `limit` payload bytes held at once (asyncio: every call on the service's event loop). `limit` None:
    unbounded until `set_limit` (the syncer knows the model's size only once it has one)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.held = 0
        """Payload bytes granted and not yet given back."""
        self.peak = 0
        self.waited = 0
        """Pushes that had to wait for bytes."""
        self._changed: asyncio.Condition | None = None

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, int(limit))

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the loop that uses it
            self._changed = asyncio.Condition()
        return self._changed

    async def acquire(self, size: int) -> int:
        """Wait until `size` bytes fit (all of the budget, for a push larger than it) and hold them; returns what
        to give back."""
        size = max(0, int(size))
        if self.limit is None:
            self.held += size
            self.peak = max(self.peak, self.held)
            return size
        size = min(size, self.limit)
        changed = self._condition()
        async with changed:
            if self.held + size > self.limit:
                self.waited += 1
                await changed.wait_for(lambda: self.held + size <= self.limit)
            self.held += size
            self.peak = max(self.peak, self.held)
        return size

    async def release(self, size: int) -> None:
        changed = self._condition()
        async with changed:
            self.held -= size
            changed.notify_all()
