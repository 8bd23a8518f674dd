"""Running a syncer: the gRPC server, its HTTP endpoint (syncer/serving/http.py), snapshots, clean shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from diloco import allocator
from diloco.atomic import private_folder, write_json
from diloco.syncer.at_rest.model_file import save_model
from diloco.config import SyncConfig
from diloco.syncer.observation.annotations import Annotations
from diloco.syncer.at_rest import initial_model
from diloco.syncer.core import SyncerCore
from diloco.syncer.kept_payloads import KeptPayloads
from diloco.syncer.defences.credentials import Credentials
from diloco.syncer.defences.credentials_watch import CredentialsWatch
from diloco.syncer.at_rest.folder_lock import FolderLock
from diloco.syncer.at_rest import history_file
from diloco.syncer.observation.history import History
from diloco.syncer.serving import handlers
from diloco.syncer.serving.http import http_server
from diloco.syncer.observation.metrics import SyncerMetrics
from diloco.syncer.serving.send_window import DEFAULT_BYTES as DEFAULT_SEND_WINDOW
from diloco.syncer.serving.service import SyncerService
from diloco.syncer.at_rest.store import StateStore
from diloco.syncer.observation.tape import Tape
from diloco.syncer.observation.throttle import Throttled
from diloco.wire.messages import SERVER_OPTIONS
from diloco.wire.tls import is_loopback, server_credentials

log = logging.getLogger("diloco.syncer")

# bounds on what grows with the learners, as shares of the model's fp32 size; `diloco syncer` reads them from here
PUSH_BUFFER = 0.25
AGREEMENT_BUFFER = 0.02
CHANGE_BUFFER = 0.05


@dataclass
class ServerOptions:
    listen: str = "127.0.0.1:50051"
    """gRPC address; port 0 picks a free port (written to out/ready.json)."""
    http: str | None = "127.0.0.1:0"
    """Address of the HTTP endpoint (the dashboard, /status, /history, /metrics); None disables it."""
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
    insecure: bool = False
    """Allow the token to travel in plaintext beyond loopback (no TLS; a warning is logged)."""
    status_token: str | None = None
    """Read-only secret for /status and /metrics beyond loopback (besides the run token)."""
    recover: bool = False
    """When the newest state in out/state is damaged, resume from the previous consistent one (--state-recover)."""
    accept_rollback: bool = False
    """Resume from out/state even when it is older than the newest state this syncer wrote, or when the record of
    that cannot be read (--accept-rollback)."""
    accept_unsigned: bool = False
    """Resume an out/state written before state keys existed: unsigned, with no trace of a key (--accept-unsigned)."""
    state_key: Path | None = None
    """The key that signs out/state's manifests; None: out/state.key, created on the first save."""
    shard: tuple[int, int] = (0, 1)
    """(i, N): serve only the fragments p with p mod N = i, as one of N syncer processes (--shard i/N)."""
    allow_takeover: bool = False
    """A Join under an id the syncer sees live supersedes that learner even without its session secret."""
    initial_model: Path | None = None
    """A safetensors file with the initial global model (--initial-model): no learner uploads it."""
    push_buffer_share: float = PUSH_BUFFER
    """Payload bytes of pushes held at once, as a share of the model's fp32 size; pushes beyond it wait (0: no
    bound; syncer/serving/push_budget.py)."""
    send_window: int = DEFAULT_SEND_WINDOW
    """Bytes an update stream may write beyond what its learner reports it received; more waits (0: no bound;
    syncer/serving/send_window.py)."""
    trim_above: int = 0
    """Every TRIM_SECONDS, give malloc's free memory back to the system when it keeps more than this many bytes
    (`allocator.trim`; 0: never)."""
    agreement_buffer_share: float = AGREEMENT_BUFFER
    """Bytes of the agreement test's payloads of open rounds kept in memory, as a share of the model's fp32 size;
    beyond it they wait in unnamed files in `out` until their round closes (0: no bound; syncer/kept_payloads.py).
    Why a fiftieth: benchmarks/LOG.md, "The open rounds' buffer at a fiftieth of the model"."""
    change_buffer_share: float = CHANGE_BUFFER
    """Bytes of downlink changes kept for learners that lag, as a share of the model's fp32 size; beyond it the oldest
    are dropped and a learner that misses one gets full values (0: no bound but the window's; downlink.bound_changes).
    Why a twentieth: benchmarks/LOG.md, "The changes' and open rounds' buffers at a twentieth of the model"."""
    exit_when_done: bool = False
    """Stop serving once the budget (token_budget, duration) is spent and no learner is live any more: each heard
    the end and left, or fell silent (`diloco syncer`; an embedded SyncerThread waits for stop())."""
    credentials: Path | None = None
    """Per-learner credentials (--credentials, syncer/defences/credentials.py): each listed id joins with its own token."""
    client_cert_ids: bool = False
    """With mutual TLS (tls_client_ca): each learner's client certificate names its id (common name) and is its
    credential (--client-cert-ids)."""


PROGRESS_EVERY_SECONDS = 60.0
"""How often the syncer logs a line of progress (at INFO, the default level of `diloco syncer`)."""
TRIM_SECONDS = 2.0
"""How often the serving loop looks at what malloc keeps free (`ServerOptions.trim_above`)."""


class ProgressLine:
    """One log line a minute: rounds and their rate, live learners, tokens, refusals and dropped rounds."""

    def __init__(self, every: float = PROGRESS_EVERY_SECONDS):
        self.every, self.at, self.rounds = every, time.monotonic(), 0

    def maybe_log(self, status: dict) -> None:
        now = time.monotonic()
        if now - self.at < self.every or not status.get("initialized"):
            return
        live = sum(1 for learner in status["learners"] if learner["state"] == "live")
        rate = (status["rounds"] - self.rounds) / (now - self.at) * 60
        progress = status.get("budget_progress")
        log.info("%d rounds (%.0f a minute), %d learner%s live of %d known, %.3g tokens trained, %.3g merged, "
                 "%d refusals, %d dropped rounds%s", status["rounds"], rate, live, "" if live == 1 else "s",
                 len(status["learners"]), status["tokens_trained"], status["tokens_merged"],
                 sum(status["refusals"].values()), status.get("dropped_rounds", 0),
                 "" if progress is None else f", {100 * progress:.0f}% of the budget")
        self.at, self.rounds = now, status["rounds"]


def exposure_problems(opts: ServerOptions) -> tuple[list[str], list[str]]:
    """What the listening addresses expose: (errors that refuse to start, warnings to log). Loopback is trusted;
    beyond it the gRPC port needs the run token, and the token must not travel in plaintext unless `insecure`."""
    errors, warnings = [], []
    if opts.client_cert_ids and not (opts.tls_client_ca and opts.tls_cert):
        errors.append("--client-cert-ids needs mutual TLS: pass --tls-cert, --tls-key and --tls-client-ca")
    if opts.token and opts.credentials:  # a shared token beside the file would let one party join as many ids
        errors.append("--token and --credentials together: any holder of the shared token could join under every id "
                      "the file does not list, as many as it likes; give each learner its own credential (`diloco "
                      "credentials new ID --file FILE`) and drop --token")

    def plaintext(text: str, fix: str) -> None:  # allowed with --insecure, as a warning
        if opts.insecure:
            warnings.append(text + " (--insecure)")
        else:
            errors.append(f"{text}; {fix}, or --insecure to accept that")

    if not is_loopback(opts.listen):
        if not (opts.token or opts.credentials or opts.client_cert_ids):
            errors.append(f"listening on {opts.listen} (beyond loopback) needs secrets: pass --credentials (a token "
                          f"per learner) or --token (one shared by trusted learners)")
        elif opts.tls_cert is None:
            plaintext(f"listening on {opts.listen} (beyond loopback) without TLS: the learners' tokens and the model travel "
                      f"in plaintext", "pass --tls-cert and --tls-key")
    if opts.http and not is_loopback(opts.http):
        if not (opts.token or opts.status_token):
            errors.append(f"serving /status and /metrics on {opts.http} (beyond loopback) needs a secret: pass "
                          f"--status-token (or --token), or bind --http to 127.0.0.1")
        elif not opts.status_token:
            plaintext(f"/status and /metrics on {opts.http} are plaintext HTTP: remote readers would send the run "
                      f"token in the clear", "pass a separate read-only --status-token")
    return errors, warnings


def health(core: SyncerCore) -> dict:
    """/status fields on the state directory: unhealthy while the latest rounds could not be made durable."""
    error = getattr(core, "state_error", None)
    return {"healthy": error is None, "state_error": error}


FALLBACK_PREFIX = "diloco-final-"
HISTORY_FILE = "history.json"
"""The dashboard's history in the state folder (`history_file`)."""


def _write_final(out: Path, name: str, write, fallback: list[Path]) -> Path | None:
    """write(path) into `out`, or, when `out` cannot take it (full, read-only), into a fallback folder (a new
    temporary one, made once and shared by every final file); returns where it went, None if nowhere."""
    try:
        write(out / name)
        return out / name
    except OSError as e:
        log.error("cannot write %s: [Errno %s] %s", out / name, e.errno, e.strerror)
    try:
        if not fallback:
            fallback.append(Path(tempfile.mkdtemp(prefix=f"{FALLBACK_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-")))
        write(fallback[0] / name)
    except OSError as e:
        log.error("cannot write %s to the fallback folder either: [Errno %s] %s", name, e.errno, e.strerror)
        return None
    log.error("wrote %s to %s instead: copy it somewhere safe", name, fallback[0] / name)
    return fallback[0] / name


async def serve(cfg: SyncConfig, opts: ServerOptions, stop: asyncio.Event | None = None, on_status=None,
                on_service=None) -> dict:
    """Serve until `stop` is set (or SIGINT/SIGTERM); returns the final status. `on_service(service)` is called
    once the service exists (tests reach the core through it)."""
    errors, warnings = exposure_problems(opts)
    if errors:
        raise ValueError("; ".join(errors))
    for warning in warnings:
        log.warning("%s", warning)
    lock = None
    if opts.out:
        private_folder(opts.out, log)  # the tape, snapshots and final model: the syncer's user's alone
        lock = FolderLock(opts.out, opts.listen)  # before anything in the folder is read or written
    try:
        return await _serve(cfg, opts, stop, on_status, on_service, lock)
    finally:
        if lock:
            lock.release()


async def _serve(cfg: SyncConfig, opts: ServerOptions, stop: asyncio.Event | None, on_status, on_service,
                 lock: FolderLock | None) -> dict:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (RuntimeError, ValueError):  # not the main thread (tests): the caller sets `stop`
            pass
    store = (StateStore(opts.out / "state", recover=opts.recover, key=opts.state_key,
                        accept_rollback=opts.accept_rollback, accept_unsigned=opts.accept_unsigned)
             if opts.out else None)
    core = SyncerCore(cfg, token_budget=opts.token_budget, duration=opts.duration, store=store, shard=opts.shard)
    if opts.agreement_buffer_share > 0:
        core.kept_payloads = KeptPayloads(opts.agreement_buffer_share, opts.out)
    if opts.change_buffer_share > 0:
        core.change_buffer = opts.change_buffer_share
    resumed = core.restore()
    if resumed:
        log.info("resumed from %s: %d rounds, versions %s", store.folder, core.rounds, [f.version for f in core.fragments])
    if opts.out:
        core.tape = Tape(opts.out / "tape.jsonl")
        core.tape.record("start", shard=list(opts.shard), config=json.loads(core.cfg.to_json()), rounds=core.rounds)
    initial = None
    if opts.initial_model and core.initialized:
        log.info("resumed from state: --initial-model %s is not used", opts.initial_model)
    elif opts.initial_model:
        initial = initial_model.load(opts.initial_model)
    metrics = SyncerMetrics()
    service = SyncerService(core, metrics, opts.token, stall_timeout=opts.stall_timeout,
                            allow_takeover=opts.allow_takeover, initial_model=initial,
                            credentials=Credentials.load(opts.credentials) if opts.credentials else None,
                            client_cert_ids=opts.client_cert_ids, push_buffer_share=opts.push_buffer_share,
                            send_window=opts.send_window)
    if on_service:
        on_service(service)
    watch = None
    if service.credentials is not None:
        await service.close_revoked()  # sessions restored from the state, checked against the file as it is now
        watch = CredentialsWatch(opts.credentials, service.use_credentials)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handlers.add_to_server(service, server, metrics.count_sent)
    credentials = server_credentials(opts.tls_cert, opts.tls_key, opts.tls_client_ca)
    try:
        port = (server.add_secure_port(opts.listen, credentials) if credentials
                else server.add_insecure_port(opts.listen))
    except RuntimeError:
        _abandon(service, core)
        raise OSError(f"cannot listen on {opts.listen} (gRPC): the port is in use (another syncer?) or cannot be "
                      f"bound here; choose another --listen port or stop the other process") from None
    if lock:
        lock.describe(f"{opts.listen.rsplit(':', 1)[0]}:{port}")
    status: dict = {}
    service.annotations = Annotations(tape=core.tape)
    beat: dict = {}
    history = History()  # what the dashboard's charts draw, for the whole run (/history)
    if opts.out and resumed:
        _resume_history(history, opts.out / HISTORY_FILE, core.started_unix)
    try:  # bound before the gRPC server starts: a busy port leaves nothing running
        http = (http_server(opts.http, service, status, [opts.token or "", opts.status_token or ""],
                             service.annotations, beat, history) if opts.http else None)
    except OSError as e:
        await server.stop(None)
        _abandon(service, core)
        raise OSError(f"cannot listen on {opts.http} (HTTP: the dashboard, /status, /metrics): {e.strerror or e}; "
                      f"choose another --http port or stop the other process") from None
    await server.start()
    ready = {"grpc_port": port, "http_port": http.server_address[1] if http else None, "pid": os.getpid()}
    log.info("syncer listening on %s (gRPC port %d%s, HTTP %s), mode %s", opts.listen, port,
             " with TLS" if credentials else "", ready["http_port"], cfg.mode)
    if http:
        log.info("dashboard: http://%s:%d/", opts.http.rsplit(":", 1)[0].strip("[]"), http.server_address[1])

    async def refresh_status() -> None:
        status.update(await service.status(), wire_bytes=metrics.total_wire_bytes(), **metrics.wire_by_direction(),
                      wire_parts=metrics.wire_by_part(), **ready, **health(core))

    await refresh_status()  # whoever reads ready.json may ask /status at once
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        write_json(opts.out / "ready.json", ready, indent=2)
    rounds = asyncio.create_task(service.run_rounds(stop))
    if watch:
        watch.start(loop)
    next_snapshot = core.clock() + opts.snapshot_seconds
    next_tokens = opts.snapshot_tokens
    write_errors = Throttled(log)
    next_history_save = time.monotonic() + history_file.SAVE_SECONDS
    progress = ProgressLine()
    next_trim = time.monotonic()
    try:
        while not stop.is_set():
            await refresh_status()
            metrics.observe_status(status)
            history.observe(status)
            progress.maybe_log(status)
            beat["at"] = time.monotonic()  # /healthz: the loop turns
            if on_status:
                on_status(dict(status))
            if opts.trim_above and time.monotonic() >= next_trim:
                next_trim = time.monotonic() + TRIM_SECONDS
                if status.get("memory", {}).get("allocator_free", 0) > opts.trim_above:
                    await loop.run_in_executor(None, allocator.trim)
            if opts.exit_when_done and run_over(core):
                log.info("the budget is spent and every learner has left: stopping")
                stop.set()
            due_time = opts.snapshot_seconds and core.clock() >= next_snapshot
            due_tokens = opts.snapshot_tokens and core.budget_tokens() >= next_tokens
            if opts.out and core.initialized and (due_time or due_tokens):
                next_snapshot = core.clock() + opts.snapshot_seconds
                next_tokens = core.budget_tokens() + opts.snapshot_tokens
                try:
                    await service._core(_snapshot, core, opts.out, status)
                except OSError as e:
                    write_errors.error("snapshot", f"cannot write a snapshot to "
                                       f"{e.filename or opts.out / 'snapshots'}: [Errno {e.errno}] {e.strerror}")
            if opts.out and core.initialized and time.monotonic() >= next_history_save:
                next_history_save = time.monotonic() + history_file.SAVE_SECONDS
                await _save_history(history, opts.out / HISTORY_FILE, write_errors)
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
    finally:
        log.info("syncer shutting down: merging what is pending")
        if opts.out and core.initialized:  # a syncer that never served has no run to chart
            await _save_history(history, opts.out / HISTORY_FILE, write_errors)
        core.stopping = True
        if watch:
            watch.stop(loop)
        await rounds
        await service.drain()
        await server.stop(grace=2.0)
        if http:
            http.shutdown()
        status.update(await service.status(), wire_bytes=metrics.total_wire_bytes(), **metrics.wire_by_direction(),
                      wire_parts=metrics.wire_by_part(), **ready)
        status["round_log"] = list(core.round_log)
        if opts.out and core.initialized:
            await service._core(core.persist, [])  # a failure is logged and recorded in state_error
            status.update(health(core))
            try:
                await service._core(_snapshot, core, opts.out, status)
            except OSError as e:
                log.error("cannot write the last snapshot to %s: [Errno %s] %s",
                          e.filename or opts.out / "snapshots", e.errno, e.strerror)
            fallback: list[Path] = []
            model = await service._core(
                _write_final, opts.out, "model.safetensors",
                lambda path: save_model(core, path, tokens_merged=core.tokens_merged()), fallback)
            status["final_model"] = None if model is None else str(model)
            _write_final(opts.out, "syncer.json", lambda path: write_json(path, status, indent=2), fallback)
        else:
            status.update(health(core))
        service.shutdown()
        core.kept_payloads.close()
        if core.tape is not None:
            core.tape.record("stop", rounds=core.rounds)
            core.tape.close()
    if opts.out and core.initialized:  # the last line says where the run's result is
        model = status.get("final_model")
        if model is None:
            raise ModelNotSaved(
                f"the final model could not be saved in {opts.out} nor in a fallback folder (a full or read-only "
                f"disk?); the last durable state is in {opts.out / 'state'}: free space and start a syncer on it")
        if Path(model).parent == opts.out:
            log.info("syncer stopped; the final model is %s", model)
        else:  # shown at the default log level: it needs the operator
            log.warning("syncer stopped; the final model is %s (a fallback folder: copy it somewhere safe)", model)
    return status


def _abandon(service: SyncerService, core: SyncerCore) -> None:
    """Undo a start that failed before serving: no thread or open file is left behind."""
    service.shutdown()
    if core.tape is not None:
        core.tape.close()


def _resume_history(history: History, path: Path, started_unix: float) -> None:
    """The dashboard's history of the run the state resumes, from `path` when it is there and sound."""
    problem = history_file.load(path, history, started_unix)
    if problem:
        log.warning("the dashboard's charts start anew: %s", problem)
    elif history.last is not None:
        log.info("the dashboard's charts resume from %s (%d samples, up to %.0f s)", path, len(history.samples),
                 history.last)


async def _save_history(history: History, path: Path, errors: Throttled) -> None:
    """Writes the history off the event loop; a disk that refuses is logged (throttled), never fatal."""
    try:
        await asyncio.to_thread(history_file.save, path, history_file.dump(history))
    except OSError as e:
        errors.error("history", f"cannot write the dashboard's history to {e.filename or path}: "
                                f"[Errno {e.errno}] {e.strerror}")


class ModelNotSaved(OSError):
    """The final model could be written nowhere: the syncer exits with an error (a saved one, fallback included,
    is a clean exit)."""


def run_over(core: SyncerCore) -> bool:
    """The run's budget is spent and no learner is live: nobody is left to serve."""
    progress = core.budget_progress()
    return progress is not None and progress >= 1.0 and not core.live()


def _snapshot(core: SyncerCore, out: Path, status: dict) -> None:
    folder = out / "snapshots"
    private_folder(folder)
    t = core.clock() - core.started_at
    save_model(core, folder / f"{t:010.3f}.safetensors", seconds=round(t, 3), tokens_trained=core.budget_tokens(),
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
            self.result.update(await serve(cfg, opts, self._stop, on_status=self._on_status,
                                           on_service=self._on_service))

        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced to the starting thread
            self.error = e
            self._ready.set()

    def _on_service(self, service: SyncerService) -> None:
        self.service = service
        """The gRPC service (its `core` is the syncer's state): for tests, read-only from outside its threads."""

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
