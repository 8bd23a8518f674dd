"""Errors that repeat every round (a full or read-only disk) logged once per interval, not once per round."""

from __future__ import annotations

import logging
import threading
import time

INTERVAL = 30.0
"""Seconds between two log lines of the same kind of error; those in between are counted and the count logged."""


class Throttled:
    """`error(kind, message)` logs (at `level`) at once the first time, then at most once per `interval` per kind,
    saying how many were left out meanwhile; `recovered(kind)` says how many were left out since the last line and
    starts over."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL, clock=time.monotonic,
                 level: int = logging.ERROR):
        self.logger, self.interval, self.clock, self.level = logger, interval, clock, level
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}
        """kind: [time of its last line, occurrences left out since]"""

    def error(self, kind: str, message: str) -> None:
        with self._lock:
            now, entry = self.clock(), self._kinds.get(kind)
            if entry is not None and now - entry[0] < self.interval:
                entry[1] += 1
                return
            left_out = entry[1] if entry is not None else 0
            self._kinds[kind] = [now, 0]
        if left_out:
            message += f" ({left_out} more like it in the last {self.interval:.0f} s not logged)"
        self.logger.log(self.level, "%s", message)

    def recovered(self, kind: str) -> int:
        """Forget `kind`; returns how many of its errors were left out of the log since its last line."""
        with self._lock:
            entry = self._kinds.pop(kind, None)
        return entry[1] if entry is not None else 0
