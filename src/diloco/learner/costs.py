"""What the learner costs the training loop it joined: the host time `Learner.step` takes (median over recent
steps, and the longest since join), the time the training thread waited on the learner (for a merged fragment
that was due), and the pinned host memory allocated since join."""

from __future__ import annotations

import statistics
import threading
from collections import deque

RECENT = 1024
"""Steps the median covers."""


class PinnedBytes:
    """Pinned host memory allocated in this process (fragment copies and arriving values), in bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes


PINNED = PinnedBytes()


class StepCosts:
    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.longest = 0.0
        self.waited = 0.0
        self._pinned_at_join = PINNED.total

    def step(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.longest = max(self.longest, seconds)

    def wait(self, seconds: float) -> None:
        self.waited += seconds

    def summary(self) -> dict:
        """host_ms_median and host_ms_max of `Learner.step`, waited_seconds, pinned_bytes (allocated in this
        process since join)."""
        return {"host_ms_median": round(1e3 * statistics.median(self.recent), 4) if self.recent else None,
                "host_ms_max": round(1e3 * self.longest, 4), "waited_seconds": round(self.waited, 6),
                "pinned_bytes": PINNED.total - self._pinned_at_join}
