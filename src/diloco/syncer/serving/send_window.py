"""How far an update stream may run ahead of what its learner has received: at most a window of bytes.

gRPC's servers accept a streamed message as soon as it is written and keep it until the network takes it, so a
stream sending full values to a learner that reads slowly had the whole payload queued in the syncer: a fragment
per learner, the syncer's memory growing with the learners (benchmarks/LOG.md, "The syncer under a load shaped
like a real run"). A learner's heartbeats say how many payload bytes its update streams have received
(`received_bytes`, also sent early once a chunk or more came in since the last report); a stream writes a chunk only
while what it wrote beyond that stays within the window. A learner that never reports (an older one) is not bounded.
Event loop only (not thread-safe).
"""

from __future__ import annotations

import asyncio

DEFAULT_BYTES = 8 << 20
"""The window: sixteen 512 KiB chunks (`wire.messages.CHUNK_BYTES`). A learner acknowledging within t seconds
receives up to 8 MiB / t (80 MiB/s at 0.1 s, its fastest acknowledgements); the syncer holds at most this much of
unsent answers per learner."""


class SendWindow:
    """One learner session's update streams: bytes written, bytes its learner says it received, and the wait."""

    def __init__(self, limit: int = DEFAULT_BYTES):
        self.limit = limit
        self.written = 0
        self.received: int | None = None
        """What the learner last reported; None until it reports (then no bound applies)."""
        self.waiting = False
        """Whether a stream waits for the learner to report (its next chunk would leave the window)."""
        self._moved = asyncio.Event()

    @property
    def ahead(self) -> int:
        """Bytes written that the learner has not said it received (0 while it does not report)."""
        return 0 if self.received is None else max(0, self.written - self.received)

    async def room_for(self, size: int) -> None:
        """Wait until `size` more bytes stay within the window (a chunk larger than it goes once nothing is ahead)."""
        while self.limit and self.received is not None and self.ahead and self.ahead + size > self.limit:
            self._moved.clear()
            self.waiting = True
            try:
                await self._moved.wait()
            finally:
                self.waiting = False
        self.written += size

    def report(self, received: int) -> None:
        """The learner's `received_bytes`; a count that goes backwards (a lying learner) is not taken."""
        if self.received is None or received > self.received:
            self.received = received
            self._moved.set()

    def stream_ended(self) -> None:
        """A stream ended with bytes perhaps never delivered: forget them, or they would shrink the window for good."""
        if self.received is not None:
            self.written = max(self.received, 0)
        self._moved.set()
