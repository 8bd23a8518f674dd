"""Helpers for multi-process tests: a liveness watchdog that records how long the global model ever went without
advancing, and polling for a condition instead of sleeping a fixed time."""

from __future__ import annotations

import json
import threading
import time
import urllib.request


class Watchdog:
    """Polls a syncer's /status; `longest_stall` is the longest time (s) in which no fragment version advanced,
    `changes` how often the versions were seen to advance."""

    def __init__(self, http_port: int, period: float = 0.1):
        self.url = f"http://127.0.0.1:{http_port}/status"
        self.period = period
        self.longest_stall = 0.0
        self.samples = 0
        self.changes = 0
        self._last_total, self._last_change = None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    total = sum(json.loads(r.read())["versions"])
            except (OSError, ValueError, KeyError):
                continue
            now = time.monotonic()
            self.samples += 1
            if total != self._last_total:
                self.changes += self._last_total is not None
                self._last_total, self._last_change = total, now
            elif self._last_change is not None and total > 0:
                self.longest_stall = max(self.longest_stall, now - self._last_change)

    def calm_stall(self, changes: int = 20, timeout: float = 120.0) -> float:
        """The longest stall over the first `changes` advances: what this machine shows right now without any fault,
        the yardstick for a fault's allowed stall (a loaded machine's steps, and so its rounds, come slower)."""
        wait_for(lambda: self.changes >= changes, timeout=timeout)
        return self.longest_stall

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.longest_stall

    def assert_alive(self, allowed: float) -> None:
        stall = self.stop()
        assert self.samples > 10, "the watchdog never heard from the syncer"
        assert stall <= allowed, f"the global model stopped advancing for {stall:.1f}s (allowed {allowed}s)"


def wait_for(condition, timeout: float = 60.0, period: float = 0.1) -> None:
    """Poll `condition` until it holds (fails after `timeout` s): a loaded machine can be far slower than usual.
    An OSError from the condition (the syncer not answering yet) counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(period)
