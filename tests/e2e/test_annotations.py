"""Annotations posted to the syncer (held-out losses, faults): validated, bounded, and a write that needs the token."""

import json
import urllib.request

import pytest

from diloco import ServerOptions, SyncerThread, for_mode
from diloco.syncer.observation import annotations
from diloco.syncer.observation.annotations import KEPT, MAX_BODY, Annotations, parse
from liveness import wait_for


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_valid_annotations_are_kept_newest_last_and_bounded():
    notes = Annotations(clock=lambda: 5.0)
    for i in range(KEPT + 3):
        notes.add(body(kind="eval", loss=2.0 + i, seconds=float(i), source="run"))
    notes.add(body(kind="fault", event="start", fault="kill", target="learner-0", seconds=1.0, duration=2.0))
    status = notes.status()
    assert len(status["global_eval"]) == KEPT and status["global_eval"][-1]["loss"] == 2.0 + KEPT + 2
    assert status["faults"] == [{"kind": "fault", "event": "start", "fault": "kill", "target": "learner-0",
                                 "seconds": 1.0, "duration": 2.0, "wall": 5.0}]


@pytest.mark.parametrize("raw, reason", [
    (b"[1]", "not a JSON object"),
    (b"\xff", "not a JSON object"),
    (body(kind="eval"), "'loss' must be"),
    (b'{"kind": "eval", "loss": NaN}', "'loss' must be"),
    (body(kind="eval", loss=1e9), "'loss' must be"),
    (body(kind="eval", loss=True), "'loss' must be"),
    (body(kind="eval", loss=1.0, tokens_trained=-1), "'tokens_trained' must be"),
    (body(kind="eval", loss=1.0, rounds=3), "unknown fields ['rounds']"),
    (body(kind="fault", event="begin", fault="kill", target="a"), "'event' must be"),
    (body(kind="fault", event="start", fault="<script>", target="a"), "'fault' must be a name"),
    (body(kind="shutdown"), "'kind' must be eval or fault"),
    (b" " * (MAX_BODY + 1), "at most"),
])
def test_bad_annotations_are_refused_with_the_reason(raw, reason):
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        parse(raw)


def test_posting_needs_the_run_token_when_there_is_one():
    syncer = SyncerThread(for_mode("decoupled", 1), ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0",
                                                                  token="run-secret", status_token="reader"))
    try:
        http = f"127.0.0.1:{syncer.status['http_port']}"
        note = {"kind": "eval", "loss": 3.0}
        assert annotations.post(http, note).startswith("HTTP 401")  # loopback, but a write: the token is needed
        assert annotations.post(http, note, token="reader").startswith("HTTP 401")  # the read-only one is not enough
        assert annotations.post(http, {"kind": "eval", "loss": -1}, token="run-secret").startswith("HTTP 400: refused")
        assert annotations.post(http, note, token="run-secret") is None
        def shown():  # /status is refreshed every 0.5 s
            with urllib.request.urlopen(f"http://{http}/status", timeout=5) as r:
                return [e["loss"] for e in json.loads(r.read()).get("global_eval", [])]
        wait_for(lambda: shown() == [3.0], timeout=10)  # the accepted one only
    finally:
        syncer.stop()
