"""The syncer's HTTP endpoint: the dashboard, /status, /history and /metrics (read with a token beyond loopback),
annotations (posted with the run token), and the schedulers' probes /healthz and /readyz (no token)."""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from diloco.syncer.observation.annotations import MAX_BODY, Annotations
from diloco.syncer.observation.history import History
from diloco.syncer.serving.service import SyncerService
from diloco.wire.bounds import json_safe
from diloco.wire.tls import is_loopback

log = logging.getLogger("diloco.syncer")


HTTP_TIMEOUT = 10.0
"""Seconds an HTTP client may take to send its request or read the reply before its connection is closed."""


def http_authorized(client_host: str, authorization: str | None, tokens: list[str]) -> bool:
    """May this HTTP request read /status or /metrics? Loopback clients always; others with `Authorization: Bearer
    <token>` naming one of `tokens` (the run token, the read-only status token)."""
    if is_loopback(f"{client_host}:0"):
        return True
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    given_bytes = given.strip().encode()
    return any(hmac.compare_digest(given_bytes, t.encode()) for t in tokens if t)


def status_json(status: dict) -> bytes:
    """/status as strict JSON: NaN and infinities become null, session ids (learners' credentials) are left out."""
    return json.dumps(json_safe(dict(status)), allow_nan=False).encode()


def dashboard_html() -> bytes:
    """The live dashboard: one self-contained page that polls /status and /history (no build step, nothing fetched
    elsewhere)."""
    return resources.files("diloco.syncer.serving").joinpath("dashboard.html").read_bytes()


def annotate_authorized(client_host: str, authorization: str | None, run_token: str) -> bool:
    """May this request post an annotation? With a run token, only who presents it (even on loopback: it is a
    write); without one (a loopback-only syncer), loopback clients."""
    if not run_token:
        return is_loopback(f"{client_host}:0")
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), run_token.encode())


LIVE_WITHIN = 30.0
"""/healthz fails when the serving loop has not refreshed the status for this many seconds (a hung event loop)."""


def probe(path: str, status: dict, beat: dict) -> tuple[int, bytes] | None:
    """/healthz (live: the serving loop turns) and /readyz (ready: it accepts joins and is not stopping) for
    schedulers' probes: no credentials needed, no secrets shown. None for any other path."""
    if path == "/healthz":
        ago = time.monotonic() - beat.get("at", float("-inf"))
        live = ago <= LIVE_WITHIN
        return (200 if live else 503), json.dumps({"live": live, "refreshed_ago": round(min(ago, 1e9), 3)}).encode()
    if path == "/readyz":
        started = bool(status)  # the first refresh comes once the gRPC port listens
        ready = started and not status.get("stopping", False)
        body = {"ready": ready, "initialized": bool(status.get("initialized")), "stopping": bool(status.get("stopping"))}
        return (200 if ready else 503), json.dumps(body).encode()
    return None


def history_query(query: str) -> float | None:
    """`since` of a /history request's query string (None: the whole history); ValueError if it is not a finite
    number."""
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == "since" and value != "":
            since = float(value)
            if not math.isfinite(since):
                raise ValueError("not finite")
            return since
    return None


def http_server(address: str, service: SyncerService, status: dict, tokens: list[str],
                 annotations: Annotations | None = None, beat: dict | None = None,
                 history: History | None = None) -> ThreadingHTTPServer:
    host, port = address.rsplit(":", 1)

    class Handler(BaseHTTPRequestHandler):
        timeout = HTTP_TIMEOUT  # a slow or silent client cannot hold its thread forever

        def _reply(self, code: int, body: bytes, kind: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            if self.path.split("?", 1)[0] != "/annotate" or annotations is None:
                self._reply(404, b"POST only /annotate\n")
                return
            if not annotate_authorized(self.client_address[0], self.headers.get("Authorization"), tokens[0]):
                self._reply(401, b"POST /annotate needs Authorization: Bearer <--token> (loopback without a token)\n")
                return
            try:
                length = int(self.headers.get("Content-Length") or -1)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                self._reply(413 if length > MAX_BODY else 411, f"need a Content-Length of at most {MAX_BODY}\n".encode())
                return
            try:
                note = annotations.add(self.rfile.read(length))
            except ValueError as e:
                self._reply(400, f"refused: {e}\n".encode())
                return
            self._reply(200, json.dumps(note).encode(), "application/json")

        def do_GET(self):  # noqa: N802 (http.server's naming)
            answer = probe(self.path.split("?", 1)[0], status, beat if beat is not None else {})
            if answer is not None:  # health probes: open to every client, they show nothing secret
                self._reply(answer[0], answer[1], "application/json")
                return
            if not http_authorized(self.client_address[0], self.headers.get("Authorization"), tokens):
                self.send_response(401)
                self.send_header("WWW-Authenticate", "Bearer")
                body = (b"beyond loopback /status, /history and /metrics need Authorization: Bearer <--status-token or "
                        b"--token>\n")
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            path, _, query = self.path.partition("?")
            if path.startswith("/metrics"):
                body, kind = service.metrics.exposition(), "text/plain; version=0.0.4"
            elif path.startswith("/status") and not status:  # the HTTP port opens just before the first refresh
                self._reply(503, b'{"starting": true}', "application/json")
                return
            elif path.startswith("/status"):
                body, kind = status_json(status), "application/json"
            elif path == "/history" and history is not None:
                try:
                    since = history_query(query)
                except ValueError:
                    self._reply(400, b"/history?since=SECONDS: a number (the `now` of a previous answer)\n")
                    return
                body, kind = status_json(history.json(since)), "application/json"
            elif path in ("/", "/dashboard"):
                body, kind = dashboard_html(), "text/html; charset=utf-8"
            else:
                self.send_error(404, "try / (the dashboard), /status, /history or /metrics")
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
    threading.Thread(target=server.serve_forever, name="syncer-http", daemon=True).start()
    return server
