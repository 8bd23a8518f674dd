"""Applies a fault schedule to a running cluster and records the timeline of what it did."""

from __future__ import annotations

import threading
from typing import Protocol

from diloco.chaos.fault_schedule import Fault

SLOW_PERIOD = 0.2  # seconds per stop/continue cycle of a slowed process


class Cluster(Protocol):
    def kill(self, target: str) -> None: ...
    def restart(self, target: str) -> None: ...
    def pause(self, target: str) -> None: ...
    def resume(self, target: str) -> None: ...
    def partition(self, target: str, seconds: float) -> None: ...


class Injector:
    """Call `tick(t)` with the seconds since training started; faults start and end on those ticks."""

    def __init__(self, faults: list[Fault], cluster: Cluster, tape=None, on_event=None):
        """`tape`: a syncer/observation/tape.Tape that gets a `fault` event as each fault starts and a `fault_end` as it ends.
        `on_event(event, t, fault)`: told the same, just before a fault starts and just after it ends."""
        self.tape = tape
        self.on_event = on_event
        self.pending = list(faults)
        self.cluster = cluster
        self.active: list[tuple[float, Fault]] = []  # (end time, fault)
        self.timeline: list[dict] = []
        self._slow: dict[str, threading.Event] = {}

    def tick(self, t: float) -> None:
        for end, fault in list(self.active):
            if t >= end:
                self.active.remove((end, fault))
                self._end(fault)
                self._record("fault_end", t, fault)
                if self.on_event:
                    self.on_event("end", t, fault)
        while self.pending and self.pending[0].at <= t:
            fault = self.pending.pop(0)
            if self.on_event:  # before: a crashing syncer still hears of its own fault
                self.on_event("start", t, fault)
            self._start(fault)
            self.active.append((t + fault.duration, fault))
            self.timeline.append({"start": round(t, 3), "end": round(t + fault.duration, 3), "kind": fault.kind,
                                  "target": fault.target})
            self._record("fault", t, fault)

    def _record(self, event: str, t: float, fault: Fault) -> None:
        if self.tape is not None:
            self.tape.record(event, kind=fault.kind, target=fault.target, run_seconds=round(t, 3),
                             duration=fault.duration)

    def _start(self, f: Fault) -> None:
        if f.kind in ("kill", "syncer-crash"):
            self.cluster.kill(f.target)
        elif f.kind == "hang":
            self.cluster.pause(f.target)
        elif f.kind == "partition":
            self.cluster.partition(f.target, f.duration)
        elif f.kind == "slow":
            stop = self._slow[f.target] = threading.Event()
            threading.Thread(target=self._duty_cycle, args=(f.target, f.factor, stop), name=f"chaos-slow-{f.target}",
                             daemon=True).start()

    def _end(self, f: Fault) -> None:
        if f.kind in ("kill", "syncer-crash"):
            self.cluster.restart(f.target)
        elif f.kind == "hang":
            self.cluster.resume(f.target)
        elif f.kind == "slow":
            self._slow.pop(f.target).set()

    def _duty_cycle(self, target: str, factor: float, stop: threading.Event) -> None:
        """Runs the process `factor` of the time: what a slower machine looks like from outside."""
        while not stop.is_set():
            self.cluster.pause(target)
            stop.wait(SLOW_PERIOD * (1 - factor))
            self.cluster.resume(target)
            stop.wait(SLOW_PERIOD * factor)

    def finish(self) -> None:
        """End every fault still active, except kills: the run is over, nothing is restarted."""
        for _, fault in self.active:
            if fault.kind in ("hang", "slow"):
                self._end(fault)
        self.active.clear()
        self.pending.clear()
