"""Running a syncer: the gRPC server, an HTTP endpoint for /status and /metrics, snapshots, clean shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from diloco.atomic import save_tensors, write_json
from diloco.config import SyncConfig
from diloco.syncer.core import SyncerCore
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.service import SyncerService
from diloco.syncer.store import StateStore
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import SERVER_OPTIONS
from diloco.wire.tls import server_credentials

log = logging.getLogger("diloco.syncer")


@dataclass
class ServerOptions:
    listen: str = "127.0.0.1:50051"
    """gRPC address; port 0 picks a free port (written to out/ready.json)."""
    http: str | None = "127.0.0.1:0"
    """Address of the HTTP /status and /metrics endpoint; None disables it."""
    out: Path | None = None
    """Directory for ready.json, snapshots, the final model and syncer.json; None writes nothing."""
    token: str | None = None
    """Shared secret learners must present; required when listening beyond loopback."""
    token_budget: int | None = None
    """Stop the run once learners have trained this many tokens in total."""
    tls_cert: Path | None = None
    """PEM certificate of the syncer; with tls_key, the gRPC port speaks TLS."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: Path | None = None
    """PEM CA whose certificates learners must present (mutual TLS); None accepts any client."""
    duration: float | None = None
    """Stop the run this many seconds after the first learner joined."""
    snapshot_tokens: int = 0
    """Also save a snapshot each time this many more tokens have been trained (0: never)."""
    stall_timeout: float = 60.0
    """Seconds the learner uploading the initial model may send nothing before another joiner takes over."""
    snapshot_seconds: float = 0.0
    """Save the global model this often into out/snapshots (0: never) — the eval-loss curve is drawn from them."""


def save_model(core: SyncerCore, path: Path, **metadata) -> None:
    save_tensors(path, core.params(), metadata)


def _http_server(address: str, service: SyncerService, status: dict) -> ThreadingHTTPServer:
    host, port = address.rsplit(":", 1)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.startswith("/metrics"):
                body, kind = service.metrics.exposition(), "text/plain; version=0.0.4"
            elif self.path.startswith("/status"):
                body, kind = json.dumps(status).encode(), "application/json"
            else:
                self.send_error(404, "try /status or /metrics")
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, int(port)), Handler)
    threading.Thread(target=server.serve_forever, name="syncer-http", daemon=True).start()
    return server


def is_loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


async def serve(cfg: SyncConfig, opts: ServerOptions, stop: asyncio.Event | None = None, on_status=None) -> dict:
    """Serve until `stop` is set (or SIGINT/SIGTERM); returns the final status."""
    if not is_loopback(opts.listen) and not opts.token:
        raise ValueError(f"listening on {opts.listen} (beyond loopback) needs a shared secret: pass --token")
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread (tests): the caller sets `stop`
            pass
    store = StateStore(opts.out / "state") if opts.out else None
    core = SyncerCore(cfg, token_budget=opts.token_budget, duration=opts.duration, store=store)
    if core.restore():
        log.info("resumed from %s: %d rounds, versions %s", store.folder, core.rounds, [f.version for f in core.fragments])
    metrics = SyncerMetrics()
    service = SyncerService(core, metrics, opts.token, stall_timeout=opts.stall_timeout)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_SyncerServicer_to_server(service, server)
    credentials = server_credentials(opts.tls_cert, opts.tls_key, opts.tls_client_ca)
    try:
        port = (server.add_secure_port(opts.listen, credentials) if credentials
                else server.add_insecure_port(opts.listen))
    except RuntimeError as e:
        raise OSError(f"cannot listen on {opts.listen}: {e} (is another syncer running there?)") from None
    await server.start()
    status: dict = {}
    http = _http_server(opts.http, service, status) if opts.http else None
    ready = {"grpc_port": port, "http_port": http.server_address[1] if http else None, "pid": os.getpid()}
    log.info("syncer listening on %s (gRPC port %d%s, HTTP %s), mode %s", opts.listen, port,
             " with TLS" if credentials else "", ready["http_port"], cfg.mode)
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        write_json(opts.out / "ready.json", ready, indent=2)
    rounds = asyncio.create_task(service.run_rounds(stop))
    next_snapshot = core.clock() + opts.snapshot_seconds
    next_tokens = opts.snapshot_tokens
    try:
        while not stop.is_set():
            status.update(await service._core(core.status), wire_bytes=metrics.total_wire_bytes(), **ready)
            metrics.observe_status(status)
            if on_status:
                on_status(dict(status))
            due_time = opts.snapshot_seconds and core.clock() >= next_snapshot
            due_tokens = opts.snapshot_tokens and core.tokens_trained() >= next_tokens
            if opts.out and core.initialized and (due_time or due_tokens):
                next_snapshot = core.clock() + opts.snapshot_seconds
                next_tokens = core.tokens_trained() + opts.snapshot_tokens
                await service._core(_snapshot, core, opts.out, status)
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
    finally:
        log.info("syncer shutting down: merging what is pending")
        core.stopping = True
        await rounds
        await service.drain()
        await server.stop(grace=2.0)
        if http:
            http.shutdown()
        status.update(await service._core(core.status), wire_bytes=metrics.total_wire_bytes(), **ready)
        status["round_log"] = list(core.round_log)
        if opts.out and core.initialized:
            await service._core(core.persist, [])
            await service._core(_snapshot, core, opts.out, status)
            save_model(core, opts.out / "model.safetensors", tokens_merged=core.tokens_merged())
            write_json(opts.out / "syncer.json", status, indent=2)
        service._pool.shutdown(wait=True)
    return status


def _snapshot(core: SyncerCore, out: Path, status: dict) -> None:
    folder = out / "snapshots"
    folder.mkdir(exist_ok=True)
    t = core.clock() - core.started_at
    save_model(core, folder / f"{t:010.3f}.safetensors", seconds=round(t, 3), tokens_trained=core.tokens_trained(),
               tokens_merged=core.tokens_merged(), rounds=core.rounds, wire_bytes=status.get("wire_bytes", 0))


class SyncerThread:
    """A syncer serving from a background thread of this process (tests, notebooks, embedding)."""

    def __init__(self, cfg: SyncConfig, opts: ServerOptions, timeout: float = 30.0):
        self._ready = threading.Event()
        self.result: dict = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(cfg, opts), name="syncer", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self.error:
            raise RuntimeError(f"syncer did not start: {self.error}")

    def _main(self, cfg, opts) -> None:
        async def main():
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self.status: dict = {}
            self.result.update(await serve(cfg, opts, self._stop, on_status=self._on_status))

        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced to the starting thread
            self.error = e
            self._ready.set()

    def _on_status(self, status: dict) -> None:
        self.status = status
        self._ready.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.status['grpc_port']}"

    def stop(self, timeout: float = 30.0) -> dict:
        """Shut down (merging what is pending) and return the final status; calling it again is harmless."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self.error:
            raise self.error
        return self.result
