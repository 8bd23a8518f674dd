"""What the dashboard's charts draw, kept by the syncer for the whole run in bounded memory: served at /history,
so a page opened late shows the run from its start.

A sample of the status every SAMPLE_SECONDS (rounds, tokens, live learners, contributors per round), a point per
learner whenever its step moved (step, loss, tokens per second; at most MAX_LEARNERS learners: a new one takes the
place of the one whose step moved least recently), the global model's held-out losses and the faults posted to
/annotate. Every series is on one time axis: seconds since the syncer started (`uptime_seconds` of /status; the
held-out losses carry the snapshot's seconds, the same clock; a fault is placed when the syncer heard of it, since
the harness counts its seconds from the run's first trained step).

Each series holds at most its cap of points. When full, every other older point is dropped (the first and the
newest kept, time order unchanged) and new points come no closer together than the thinned ones: the whole run
stays covered at a coarser resolution, and memory does not grow with the run's length.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict

SAMPLE_SECONDS = 2.0
"""Seconds between samples of the status (until thinning makes them coarser)."""
MAX_SAMPLES = 2000
"""Samples of the run's figures kept."""
MAX_LEARNER_POINTS = 1000
"""Points kept per learner."""
MAX_LEARNERS = 16
"""Learners whose series are kept: the ones whose step moved most recently."""
MAX_EVALS = 1000
"""Held-out losses of the global model kept."""
MAX_FAULTS = 1000
"""Fault starts and ends kept: the latest ones."""

SAMPLE_FIELDS = ("rounds", "tokens_trained", "tokens_merged", "live", "contributors")
LEARNER_FIELDS = ("step", "loss", "tokens_per_second")
EVAL_FIELDS = ("loss", "tokens_trained")
FAULT_FIELDS = ("event", "fault", "target", "duration")


def _rounded(x, digits: int):
    """A float to `digits` decimals (the JSON stays small); anything else (None, a count) as it is."""
    return round(x, digits) if isinstance(x, float) and x == x and abs(x) != float("inf") else x


def _after(entries: list[dict], last: tuple | None, fields: tuple[str, ...]) -> tuple[list[dict], tuple | None]:
    """The entries of a status list (oldest first, the oldest dropped as it grows) that come after the one whose
    `fields` were `last`, and the newest one's fields: what the next call passes as `last`."""
    keys = [tuple(e.get(k) for k in fields) for e in entries]
    new = entries
    if last is not None and last in keys:
        new = entries[len(keys) - keys[::-1].index(last):]
    return new, (keys[-1] if keys else last)


class Series:
    """Points (t, *fields) in time order, at most `cap` of them, each remembering when it was added (the cursor
    of `since`). When full, thinned: every other point but the newest is dropped, and the spacing new points need
    becomes the average spacing of what is left. With `latest`, the oldest point is dropped instead (events, where
    every one counts and half of them would mean nothing)."""

    def __init__(self, fields: tuple[str, ...], cap: int, every: float = 0.0, latest: bool = False):
        if cap < 3:
            raise ValueError("a series keeps at least 3 points")
        self.fields, self.cap, self.every, self.latest = fields, cap, every, latest
        self.rows: list[tuple] = []  # (added, t, *values)
        self.thinned = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, added: float, t: float, *values) -> bool:
        """Keep one point; False when it came closer than `every` after the newest one (dropped). A point older
        than the newest is put in its place in time. Thins the series when it is over its cap."""
        if self.rows and t >= self.rows[-1][1]:
            if t - self.rows[-1][1] < self.every:
                return False
            self.rows.append((added, t, *values))
        else:
            i = bisect_right([r[1] for r in self.rows], t)
            self.rows.insert(i, (added, t, *values))
        if len(self.rows) > self.cap:
            self.thin()
        return True

    def thin(self) -> None:
        if self.latest:
            del self.rows[0]
            self.thinned += 1
            return
        kept = self.rows[:-1:2] + [self.rows[-1]]  # the first point, every other one after it, the newest
        span = kept[-1][1] - kept[0][1]
        self.every = max(self.every, span / (len(kept) - 1))
        self.rows = kept
        self.thinned += 1

    def columns(self, since: float | None = None) -> dict[str, list]:
        """{"t": [...], field: [...]} of the points added after `since` (all of them for None)."""
        rows = self.rows if since is None else [r for r in self.rows if r[0] > since]
        return {name: [r[i + 1] for r in rows] for i, name in enumerate(("t",) + self.fields)}


class History:
    """The run's history for the dashboard, fed the status as the syncer refreshes it (`observe`, from the serving
    loop) and read as JSON (`json`, from the HTTP threads)."""

    def __init__(self, every: float = SAMPLE_SECONDS, max_samples: int = MAX_SAMPLES,
                 max_learner_points: int = MAX_LEARNER_POINTS, max_learners: int = MAX_LEARNERS,
                 max_evals: int = MAX_EVALS, max_faults: int = MAX_FAULTS):
        self.samples = Series(SAMPLE_FIELDS, max_samples, every)
        self.learners: OrderedDict[str, Series] = OrderedDict()  # least recently moved first
        self.evals = Series(EVAL_FIELDS, max_evals)
        self.faults = Series(FAULT_FIELDS, max_faults, latest=True)
        self.max_learner_points, self.max_learners = max_learner_points, max_learners
        self.started_unix: float | None = None
        self.last: float | None = None  # seconds of the latest sample: the cursor
        self.forgotten = 0  # learners dropped for newer ones
        self._steps: dict[str, int] = {}  # each learner's step in the latest sample (those the status lists)
        self._dropped: set[str] = set()  # learners dropped for newer ones, while the status still lists them
        self._last_eval: tuple | None = None  # the newest held-out loss taken from the status
        self._last_fault: tuple | None = None  # the newest fault taken from the status
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        """Changes whenever points already served were dropped (thinning, a forgotten learner): a reader holding
        them reloads the whole history instead of adding to what it has."""
        return (self.samples.thinned + self.evals.thinned + self.faults.thinned + self.forgotten
                + sum(s.thinned for s in self.learners.values()))

    def observe(self, status: dict) -> bool:
        """Take a sample of `status` (a /status dict) if one is due; returns whether one was taken."""
        t = status.get("uptime_seconds")
        if t is None:
            return False
        t = float(t)
        with self._lock:
            if self.last is not None and t - self.last < self.samples.every:
                return False
            self.started_unix = status.get("started_unix", self.started_unix)
            learners = status.get("learners") or []
            fresh = [r for r in status.get("recent_rounds") or () if self.last is None or r[0] > self.last]
            contributors = sum(r[3] for r in fresh) / len(fresh) if fresh else None
            self.samples.add(t, t, status.get("rounds", 0), status.get("tokens_trained", 0),
                             status.get("tokens_merged", 0), sum(1 for x in learners if x.get("state") == "live"),
                             None if contributors is None else round(contributors, 3))
            for learner in learners:
                self._learner_point(t, learner)
            self._steps = {x["id"]: x.get("step") for x in learners if isinstance(x.get("id"), str)}
            self._dropped &= set(self._steps)
            self._eval_points(t, status.get("global_eval") or [])
            self._fault_points(t, status.get("faults") or [])
            self.last = t
            return True

    def _learner_point(self, t: float, learner: dict) -> None:
        name, step = learner.get("id"), learner.get("step")
        loss, rate = learner.get("loss"), learner.get("tokens_per_second")
        if not isinstance(name, str) or step is None or (loss is None and rate is None):
            return
        if (name in self._steps and self._steps[name] == step) or name in self._dropped:
            return  # nothing new (a learner that stopped adds no flat line), or a learner dropped for newer ones
        series = self.learners.get(name)
        if series is None:
            series = self.learners[name] = Series(LEARNER_FIELDS, self.max_learner_points)
            if len(self.learners) > self.max_learners:
                gone, _ = self.learners.popitem(last=False)  # the one whose step moved least recently
                self._dropped.add(gone)  # not taken back while it is listed: more moving learners than the bound
                self.forgotten += 1      # would otherwise push each other out at every sample
        self.learners.move_to_end(name)
        series.add(t, t, step, _rounded(loss, 5), _rounded(rate, 1))

    def _eval_points(self, t: float, evals: list[dict]) -> None:
        new, self._last_eval = _after(evals, self._last_eval, ("wall", "seconds", "loss"))
        for e in new:
            seconds = e.get("seconds")
            if seconds is None and e.get("wall") is not None and self.started_unix is not None:
                seconds = max(0.0, e["wall"] - self.started_unix)  # a loss posted without the snapshot's time
            if seconds is not None and e.get("loss") is not None:
                self.evals.add(t, round(float(seconds), 3), _rounded(e["loss"], 5), e.get("tokens_trained"))

    def _fault_points(self, t: float, faults: list[dict]) -> None:
        new, self._last_fault = _after(faults, self._last_fault, ("wall", "event", "fault", "target"))
        for f in new:
            wall = f.get("wall")
            if isinstance(wall, (int, float)) and self.started_unix is not None:
                self.faults.add(t, round(max(0.0, wall - self.started_unix), 3), f.get("event"), f.get("fault"),
                                f.get("target"), f.get("duration"))

    def json(self, since: float | None = None) -> dict:
        """What /history serves: the points added after `since` (a previous answer's `now`), all for None."""
        with self._lock:
            learners = {name: s.columns(since) for name, s in self.learners.items()}
            return {
                "started_unix": self.started_unix,
                "now": self.last,
                "since": since,
                "generation": self.generation,
                "every": self.samples.every,
                "samples": self.samples.columns(since),
                "learners": {name: cols for name, cols in learners.items() if cols["t"]},
                "global_eval": self.evals.columns(since),
                "faults": self.faults.columns(since),
                "bounds": {"samples": self.samples.cap, "learner_points": self.max_learner_points,
                           "learners": self.max_learners, "global_eval": self.evals.cap, "faults": self.faults.cap},
            }
