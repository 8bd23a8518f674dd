"""Each learner's queue of outgoing merged fragments and resyncs, bounded whether or not anybody reads it."""

from __future__ import annotations

import asyncio
from collections import deque

def _publication(item):
    return item[0] if isinstance(item, tuple) else item


class UpdateQueue:
    """One learner's outgoing merged fragments and resyncs, bounded whether or not anybody reads them.

    Full values for a fragment supersede everything queued for it (the learner ends up holding exactly them, which
    is what the core recorded), so repeated refusals of one fragment keep one fp32 copy, not one each. Beyond
    `limit` items (a client that pushes but never subscribes) the oldest is dropped."""

    def __init__(self, limit: int):
        self.limit = limit
        self.dropped = 0
        self._items: deque = deque()
        self._ready = asyncio.Event()

    def put_nowait(self, item) -> None:
        if item is not None:
            pub = _publication(item)
            if pub.full:
                self._items = deque(i for i in self._items if i is None or _publication(i).fragment != pub.fragment)
            while len(self._items) >= self.limit:
                self._items.popleft()
                self.dropped += 1
        self._items.append(item)
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)

    def payloads(self) -> list:
        """The encoded payloads waiting in this queue (for the memory report)."""
        return [_publication(i).payload for i in list(self._items) if i is not None]
