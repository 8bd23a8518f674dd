"""What the syncer cannot know by itself, posted to it for the dashboard: the global model's held-out loss (from an
evaluator of its snapshots, as `diloco run` does) and faults (from the chaos harness).

    POST /annotate  {"kind": "eval", "loss": 2.31, "tokens_trained": 1048576, "seconds": 60.2, "source": "run"}
    POST /annotate  {"kind": "fault", "event": "start", "fault": "kill", "target": "learner-1", "seconds": 12.0,
                     "duration": 20.0}

A body is untrusted: it is parsed with a size bound, every field checked, and only the latest KEPT of each kind
are kept. Annotations go on the tape and into /status; they never change training.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import deque

MAX_BODY = 4096
"""Largest body accepted, in bytes."""
KEPT = 500
"""Annotations of each kind kept for /status (older ones stay on the tape)."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
MAX_COUNT = 2**53


def _number(body: dict, key: str, low: float, high: float, required: bool = False) -> float | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{key!r} must be a finite number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _name(body: dict, key: str, required: bool = True) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(f"{key!r} must be a name of 1 to 64 letters, digits or ._:-, got {value!r}")
    return value


def parse(raw: bytes) -> dict:
    """One annotation from a request body; ValueError says what is wrong with it."""
    if len(raw) > MAX_BODY:
        raise ValueError(f"body of {len(raw)} bytes; at most {MAX_BODY}")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=lambda c: float("nan"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a JSON object: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    kind = body.get("kind")
    if kind == "eval":
        out = {"kind": "eval", "loss": _number(body, "loss", 0.0, 1e6, required=True),
               "tokens_trained": _number(body, "tokens_trained", 0, MAX_COUNT),
               "seconds": _number(body, "seconds", 0.0, 1e9), "source": _name(body, "source", required=False)}
    elif kind == "fault":
        event = body.get("event")
        if event not in ("start", "end"):
            raise ValueError(f"'event' must be start or end, got {event!r}")
        out = {"kind": "fault", "event": event, "fault": _name(body, "fault"), "target": _name(body, "target"),
               "seconds": _number(body, "seconds", 0.0, 1e9), "duration": _number(body, "duration", 0.0, 1e9)}
    else:
        raise ValueError(f"'kind' must be eval or fault, got {kind!r}")
    unknown = set(body) - set(out)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for kind {kind!r}")
    return {k: v for k, v in out.items() if v is not None}


class Annotations:
    """The latest annotations of each kind; safe from any thread."""

    def __init__(self, clock=time.time, tape=None):
        self.clock = clock
        self.tape = tape
        self._kept = {"eval": deque(maxlen=KEPT), "fault": deque(maxlen=KEPT)}
        self._lock = threading.Lock()

    def add(self, raw: bytes) -> dict:
        """Validate and keep one posted body; raises ValueError (the reason) if it is refused."""
        note = {**parse(raw), "wall": round(self.clock(), 3)}
        with self._lock:
            self._kept[note["kind"]].append(note)
        if self.tape is not None:
            self.tape.record("annotation", **note)
        return note

    def status(self) -> dict:
        with self._lock:
            return {"global_eval": list(self._kept["eval"]), "faults": list(self._kept["fault"])}


def post(http: str, note: dict, token: str = "", timeout: float = 2.0) -> str | None:
    """POST one annotation to a syncer's HTTP address (host:port); returns None, or why it did not arrive (an
    annotation is worth a try, never a failed run)."""
    request = urllib.request.Request(f"http://{http}/annotate", data=json.dumps(note).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
        return None
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError) as e:
        return str(e)
