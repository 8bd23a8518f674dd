"""The event tape: every round, join, leave, refusal and expiry as one JSON line, with monotonic and wall time,
in `tape.jsonl` of the syncer's --state directory, size-bounded and rotated (logging's RotatingFileHandler).
`diloco inspect TAPE` summarises one."""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path

from diloco.atomic import private_opener
from diloco.syncer.observation.throttle import Throttled

MAX_BYTES = 64 * 1024 * 1024
"""Size of tape.jsonl before it is rotated to tape.jsonl.1 (…, up to BACKUPS older files)."""
BACKUPS = 4


class _Handler(logging.handlers.RotatingFileHandler):
    """Files created 0600; a write that fails (a full or read-only disk) loses the event and is logged once per
    interval with a count, instead of logging's traceback per event on stderr."""

    def __init__(self, path: Path, failures: Throttled, **kwargs):
        self.failures = failures  # (`errors` is the handler's encoding-error policy)
        super().__init__(path, **kwargs)

    def _open(self):
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors, opener=private_opener)

    def handleError(self, record) -> None:  # noqa: N802 (logging's naming)
        e = sys.exc_info()[1]
        why = f"[Errno {e.errno}] {e.strerror}" if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        self.failures.error("tape", f"cannot write the event tape {self.baseFilename}: {why}; events are lost until it "
                                  f"takes writes again")


class Tape:
    """Writes events; `record(kind, **fields)` is safe from any thread (logging's handler holds a lock)."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._logger = logging.getLogger(f"diloco.tape.{id(self)}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self.errors = Throttled(logging.getLogger("diloco.syncer"))
        try:
            self._handler = _Handler(self.path, self.errors, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        except OSError as e:
            raise OSError(f"cannot open the event tape {self.path}: [Errno {e.errno}] {e.strerror} (the syncer makes "
                          f"it a plain file: remove what is there)") from None
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)

    def record(self, kind: str, /, **fields) -> None:
        event = {"event": kind, "mono": round(time.monotonic(), 6), "wall": round(time.time(), 6), **fields}
        self._logger.info(json.dumps(event, allow_nan=False, default=str))

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        try:
            self._handler.close()  # flushes: on a full disk what is buffered cannot be written
        except OSError as e:
            self.errors.error("tape", f"cannot write the event tape {self.path}: [Errno {e.errno}] {e.strerror}; its "
                                      f"last events are lost")


def read_all(paths: list[Path]) -> list[dict]:
    """Several tapes (a syncer's, its shards', a run's faults.jsonl) as one, in wall-clock order."""
    events = [e for path in paths for e in read(path)]
    return sorted(events, key=lambda e: e.get("wall", 0.0))


def read(path: Path) -> list[dict]:
    """A tape's events, oldest first, rotated files included; a line cut by a crash is skipped."""
    path = Path(path)
    files = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    events = []
    for f in [*files, path]:
        if not f.exists():
            continue
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    values = sorted(values)
    at = lambda q: values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]  # noqa: E731
    return {"count": len(values), "median": at(0.5), "p90": at(0.9), "max": values[-1]}


def summarise(events: list[dict]) -> dict:
    """What `diloco inspect` prints: participation, measured H per fragment, staleness, grace and refusals."""
    rounds = [e for e in events if e.get("event") == "round"]
    contributions = [c for r in rounds for c in r.get("contributors", [])]
    per_fragment: dict[int, list[dict]] = {}
    for r in rounds:
        per_fragment.setdefault(r["fragment"], []).append(r)
    participation: dict[int, int] = {}
    for r in rounds:
        n = len(r.get("contributors", []))
        participation[n] = participation.get(n, 0) + 1
    staleness: dict[int, int] = {}
    for c in contributions:
        staleness[c["staleness"]] = staleness.get(c["staleness"], 0) + 1
    refusals: dict[str, int] = {}
    for e in events:
        if e.get("event") == "refusal":  # a join's reason is already short ("join: model mismatch")
            reason = str(e.get("reason", ""))
            reason = reason if e.get("rpc") == "join" else reason.split(":")[0]
            refusals[reason] = refusals.get(reason, 0) + 1
    span = [e["wall"] for e in events if "wall" in e]
    return {
        "events": len(events),
        "seconds": round(max(span) - min(span), 3) if span else 0.0,
        "rounds": len(rounds),
        "contributors_per_round": dict(sorted(participation.items())),
        "fragments": {p: {"rounds": len(rs),
                          "mean_contributors": round(sum(len(r["contributors"]) for r in rs) / len(rs), 3),
                          "measured_h": round(sum(c["steps"] for r in rs for c in r["contributors"])
                                              / max(1, sum(len(r["contributors"]) for r in rs)), 3)}
                      for p, rs in sorted(per_fragment.items())},
        "staleness": dict(sorted(staleness.items())),
        "round_open_seconds": _quantiles([r["open_seconds"] for r in rounds if r.get("open_seconds") is not None]),
        "quorum_seconds": _quantiles([r["quorum_seconds"] for r in rounds if r.get("quorum_seconds") is not None]),
        "refusals": refusals,
        "faults": [{k: e.get(k) for k in ("kind", "target", "run_seconds", "duration")}
                   for e in events if e.get("event") == "fault"],
        "joins": sum(e.get("event") == "join" for e in events),
        "leaves": sum(e.get("event") == "leave" for e in events),
    }


def _counts(console, title: str, columns: tuple[str, ...], rows) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def render(summary: dict, console) -> None:
    """`diloco inspect`'s tables of a `summarise` result on a rich console."""
    console.print(f"{summary['events']:,} events over {summary['seconds']:,.0f} s: {summary['rounds']:,} rounds, "
                  f"{summary['joins']} joins, {summary['leaves']} leaves")
    _counts(console, "contributors per round", ("contributors", "rounds"),
            ((str(n), f"{count:,}") for n, count in summary["contributors_per_round"].items()))
    _counts(console, "per fragment", ("fragment", "rounds", "mean contributors", "measured H (steps per contribution)"),
            ((str(p), f"{f['rounds']:,}", f"{f['mean_contributors']:.2f}", f"{f['measured_h']:.1f}")
             for p, f in summary["fragments"].items()))
    _counts(console, "staleness of merged contributions (versions behind)", ("staleness", "contributions"),
            ((str(s), f"{count:,}") for s, count in summary["staleness"].items()))
    for key, title in (("round_open_seconds", "round open, first push to close"),
                       ("quorum_seconds", "round open to quorum")):
        q = summary[key]
        if q:
            console.print(f"{title}: median {q['median']:.3f} s, p90 {q['p90']:.3f} s, max {q['max']:.3f} s "
                          f"({q['count']:,} rounds)")
    if summary["refusals"]:
        console.print("refusals: " + ", ".join(f"{k} {v:,}" for k, v in summary["refusals"].items()))
    for f in summary["faults"]:
        console.print(f"fault: {f['kind']} {f['target']} at {f['run_seconds']:.0f} s for {f['duration']:.0f} s")
