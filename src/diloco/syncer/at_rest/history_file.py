"""The dashboard's history on disk beside the syncer's state (`history.json`), so that a restarted syncer's charts
still show its run from the start: written every SAVE_SECONDS and at shutdown, read back when the state resumes.

Only a file of the run the state resumes is read (the same `started_unix`, which the state keeps), and the file is
untrusted: every field is checked against the shape the history has in memory, bounds included. A file that fails
a check is not used and the history starts empty; the history is for display and never stops a syncer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

from diloco import untrusted_files
from diloco.atomic import write_json
from diloco.ids import LEARNER_ID
from diloco.syncer.observation.annotations import NAME
from diloco.syncer.observation.history import LEARNER_FIELDS, History, Series

FORMAT = 1
SAVE_SECONDS = 30.0
"""Seconds between saves: what a SIGKILLed syncer's charts lose at most."""
MAX_BYTES = 64 << 20
"""Largest file read (a full history is under 1 MB of columns; rows with their cursor, a few MB)."""


def dump(history: History) -> dict:
    """Everything `load` needs to rebuild `history`, as JSON-ready lists (a consistent copy, taken under its lock)."""
    def series(s: Series) -> dict:
        return {"every": s.every, "thinned": s.thinned, "rows": [list(r) for r in s.rows]}

    with history._lock:
        return {"format": FORMAT, "started_unix": history.started_unix, "last": history.last,
                "forgotten": history.forgotten, "samples": series(history.samples), "evals": series(history.evals),
                "faults": series(history.faults),
                "learners": [[name, series(s)] for name, s in history.learners.items()]}


def save(path: Path, dumped: dict) -> None:
    """Writes a `dump` atomically (OSError when the disk refuses)."""
    write_json(path, dumped)


def load(path: Path, history: History, started_unix: float) -> str | None:
    """Fills the empty `history` from the file at `path`, if there is one; returns None, or why the file there was
    not used."""
    try:
        data = untrusted_files.read_json(path, MAX_BYTES, parse_constant=_refuse_constant)
    except FileNotFoundError:
        return None  # a state from before the first save
    except untrusted_files.TooLarge as e:
        return f"{path} is {e.why}"
    except (OSError, ValueError) as e:  # a FIFO, a device, a link, not JSON, nested too deep
        return f"{path} cannot be read: {getattr(e, 'why', e)}"
    try:
        _restore(data, history, started_unix)
    except (ValueError, TypeError, KeyError) as e:
        return f"{path} is not a history of this run: {e}"
    return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number the history holds")


def _restore(data: dict, history: History, started_unix: float) -> None:
    """Checks every field of `data` before anything of `history` changes."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"format is not {FORMAT}")
    if data.get("started_unix") != started_unix:
        raise ValueError(f"it began at {data.get('started_unix')!r}, the state's run at {started_unix!r}")
    last = _seconds(data["last"], "last", optional=True)
    forgotten = _count(data["forgotten"], "forgotten")
    samples = _series(data["samples"], history.samples, "samples")
    evals = _series(data["evals"], history.evals, "evals")
    faults = _series(data["faults"], history.faults, "faults", FAULT_CHECKS)
    learners = data["learners"]
    if not isinstance(learners, list) or len(learners) > history.max_learners:
        raise ValueError(f"learners: a list of at most {history.max_learners}")
    kept: OrderedDict[str, Series] = OrderedDict()
    for pair in learners:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and LEARNER_ID.fullmatch(pair[0]) and pair[0] not in kept):
            raise ValueError("learners: [learner id, series] pairs, each id once")
        kept[pair[0]] = _series(pair[1], Series(LEARNER_FIELDS, history.max_learner_points), f"learner {pair[0]}")
    history.samples, history.evals, history.faults, history.learners = samples, evals, faults, kept
    history.started_unix, history.last, history.forgotten = started_unix, last, forgotten


def _series(data: dict, like: Series, what: str, checks: dict | None = None) -> Series:
    """A Series with `like`'s fields and bounds, from checked rows: each value by its field's check in `checks`
    (a finite number or null where none is named)."""
    if not isinstance(data, dict):
        raise ValueError(f"{what}: not an object")
    rows = data["rows"]
    if not isinstance(rows, list) or len(rows) > like.cap:
        raise ValueError(f"{what}: rows must be a list of at most {like.cap}")
    series = Series(like.fields, like.cap, _seconds(data["every"], f"{what} every"), like.latest)
    series.thinned = _count(data["thinned"], f"{what} thinned")
    previous = 0.0
    for row in rows:
        if not isinstance(row, list) or len(row) != 2 + len(like.fields):
            raise ValueError(f"{what}: a row is [added, t, {', '.join(like.fields)}]")
        added, t = _seconds(row[0], f"{what} added"), _seconds(row[1], f"{what} t")
        if t < previous:
            raise ValueError(f"{what}: rows out of time order")
        previous = t
        series.rows.append((added, t, *((checks or {}).get(name, _number)(v, f"{what} {name}")
                                        for name, v in zip(like.fields, row[2:]))))
    return series


def _seconds(value, what: str, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e12:
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    return float(value)


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise ValueError(f"{what} must be a count, got {value!r}")
    return value


def _number(value, what: str):
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        return value
    raise ValueError(f"{what} must be a finite number or null, got {value!r}")


def _event(value, what: str) -> str:
    if value in ("start", "end"):
        return value
    raise ValueError(f"{what} must be start or end, got {value!r}")


def _name(value, what: str) -> str | None:
    if value is None or (isinstance(value, str) and NAME.fullmatch(value)):
        return value
    raise ValueError(f"{what} must be a name of 1 to 64 letters, digits or ._:-, got {value!r}")


FAULT_CHECKS = {"event": _event, "fault": _name, "target": _name}
