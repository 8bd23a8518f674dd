"""The learner's connection to a remote syncer: gRPC calls on background threads, with retries and backoff.

Threads: `sender` encodes and pushes outer gradients in order; `receiver` holds the Subscribe stream and
reassembles merged fragments; `heartbeat` reports progress and learns when the run is over. The training thread
only enqueues pushes and drains arrivals.

Transfers (Join, Init, Push) have no fixed deadline: a big model on a slow link may take as long as it needs. A
transfer is cancelled only when nothing moved for `stall_timeout` seconds, and the error then says how far it got.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Callable

import grpc
import torch

from diloco.algorithm import codec
from diloco.ids import InvalidLearnerId, check_learner_id
from diloco.config import SyncConfig
from diloco.algorithm.fragments import TensorSpec
from diloco.learner import heap
from diloco.learner.transfer_progress import Furthest, Progress, Stalled, megabytes
from diloco.learner.transport import Arrival, HeartbeatNews, JoinInfo, PushJob, Receiver, SyncerError
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.bounds import shown
from diloco.wire.messages import (CHUNK_BYTES, GRPC_OPTIONS, REPORT_BYTES, Assembler, blobs, push_chunks,
                                   specs_to_proto, wire_size)
from diloco.wire.tls import channel_credentials, tls_problem

log = logging.getLogger("diloco.learner")
MAX_BACKOFF = 2.0  # seconds between retries at most: a returning syncer is noticed within about that
EARLY_REPORT_SECONDS = 0.1
"""Heartbeats sent early to report received update bytes come at most this often (the syncer's floor per
credential is 20 a second)."""
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
SLOW = "the link is too slow or down (raise stall_timeout / --stall-timeout)"
BACKGROUND_NICE = 10
"""How much lower than the training thread's the sender's and receiver's CPU priority is (a nice value)."""


def as_background() -> None:
    """Lower this thread's CPU priority by BACKGROUND_NICE, so that encoding and decoding give way to the training
    thread where cores are short (Linux gives each thread its own nice value; elsewhere a no-op). The heartbeat
    thread keeps its priority: it is what tells the syncer this learner is alive."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError):
        pass


def background(loop):
    def run() -> None:
        as_background()
        loop()
    return run


class GrpcTransport(HeartbeatNews):
    """Connects a Learner to `diloco syncer` at `address` ("host:port")."""

    def __init__(self, address: str, token: str = "", connect_timeout: float = 30.0, rpc_timeout: float = 5.0,
                 tls: bool = False, tls_ca=None, tls_cert=None, tls_key=None, stall_timeout: float = 60.0,
                 session: str = ""):
        """`connect_timeout`: how long to keep trying to reach the syncer on join (waiting while another learner
        uploads the initial model does not count, as long as the syncer answers; a download that broke part-way starts
        it again). `stall_timeout`: a join, upload or push is given up only after nothing moved for this long — there
        is no limit on a transfer's total time; a join or upload that broken connections start over is given up once
        no attempt got further for this long.
        `rpc_timeout`: deadline of the small calls at shutdown (the last heartbeat, Leave).
        `tls` (or any tls_* file) connects with TLS, trusting `tls_ca` or the system's roots; `tls_cert` and
        `tls_key` present a client certificate to a syncer that requires one. `session`: the session secret of
        the Learner that held this id before (its `transport.session`), to take the id over while the syncer
        still sees that one live; without it a live id is refused."""
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout}")
        self.address = address
        self.token = token
        self.session = session
        self.connect_timeout = connect_timeout
        self.rpc_timeout = rpc_timeout
        self.stall_timeout = stall_timeout
        self.tls = bool(tls or tls_ca or tls_cert or tls_key)
        self.channel = (grpc.secure_channel(address, channel_credentials(tls_ca, tls_cert, tls_key), options=GRPC_OPTIONS)
                        if self.tls else grpc.insecure_channel(address, options=GRPC_OPTIONS))
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.receiver = Receiver()
        self.keeps_initial: Callable[[int], bool] = lambda fragment: True
        """Which fragments' initial values this syncer keeps (a shard: its own); the others are uploaded empty."""
        self.error: SyncerError | None = None
        self.bytes_sent = self.bytes_received = 0
        self._pushes: queue.Queue[tuple[int, PushJob] | None] = queue.Queue()
        self._tickets = itertools.count()
        self._undelivered: dict[int, PushJob] = {}
        """Pushes queued or being sent, by ticket: removed once the syncer answered (accepted, refused, duplicate)."""
        self._join_attempt = Progress(stall_timeout)
        """How far the latest join's download got."""
        self._push_progress: Progress | None = None
        """The push being sent now."""
        self._answered_at = time.monotonic()
        """When the syncer last answered a push."""
        self._push_call = None
        self._closing = threading.Event()
        self._closed = False
        self._stop_requested = False
        self._progress: dict = {}
        self._threads: list[threading.Thread] = []
        self._subscription = None
        self._ef = codec.ErrorFeedback()
        self._inflight: dict[int, PushJob] = {}
        """Pushes whose merged result has not arrived: re-sent (same seq) after the update stream reconnects."""
        self._received_data = 0
        """Payload bytes this session's update streams brought: heartbeats report it, and the syncer sends at most
        its send window beyond (syncer/serving/send_window.py)."""
        self._reported_data = 0
        self._report_due = threading.Event()
        """Set when a chunk or more came in since the last report: the heartbeat goes early."""

    # ---- joining ------------------------------------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], initial) -> JoinInfo:
        self.learner_id = learner_id
        try:  # the syncer refuses it too; saying so here is clearer (and a 20 KB id is no request to send)
            check_learner_id(learner_id)
        except InvalidLearnerId:
            raise SyncerError(f"invalid learner id {shown(learner_id)}: use 1-64 letters, digits, '.', '_' or '-', "
                              f"starting with a letter or digit") from None
        digests = getattr(initial, "digests", None)  # the fragments still at these values are not sent to us
        request = pb.JoinRequest(learner_id=learner_id, specs=specs_to_proto(specs), token=self.token,
                                 session=self.session, held=digests() if digests else [])
        self._max_payload = 4 * sum(s.numel for s in specs) + CHUNK_BYTES
        """No payload from the syncer can be larger than the whole model in fp32: a bound before buffers are made."""
        started = time.monotonic()
        deadline, delay, attempts = started + self.connect_timeout, 0.2, 0
        self._answered = False
        upload, download = Furthest(self.stall_timeout), Furthest(self.stall_timeout)
        while True:
            attempts += 1
            try:
                reply = self._join_once(request, initial)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.ABORTED:  # our upload of the initial model was taken over: join again
                    log.info("%s", e.details())
                    deadline = time.monotonic() + self.connect_timeout
                elif code not in RETRYABLE and code != grpc.StatusCode.ALREADY_EXISTS:
                    raise SyncerError(f"syncer at {self.address} refused learner {shown(learner_id)}: {e.details()}") from None
                elif self.tls and code == grpc.StatusCode.UNAVAILABLE and tls_problem(e.details(), self.address):
                    raise SyncerError(tls_problem(e.details(), self.address)) from None  # retrying cannot fix it
                elif self._join_attempt.done:  # the model's download broke part-way: start over while it gets further
                    if download.broke(self._join_attempt):
                        raise SyncerError(f"join stalled: the download of the model from the syncer at {self.address} "
                                          f"{download.describe(self._join_attempt.total, e)}; {SLOW}") from None
                    log.warning("the join's download of the model broke after %s (%s: %s); joining again to start over",
                                self._join_attempt.describe(), code.name, e.details())
                    deadline = time.monotonic() + self.connect_timeout  # for reaching the syncer again
                elif time.monotonic() + delay > deadline:
                    raise self._join_failed(e, attempts, time.monotonic() - started) from None
                else:  # unreachable, or ALREADY_EXISTS: the old session under this id may be ending (a crash)
                    log.info("cannot join the syncer at %s yet (%s: %s); retrying in %.1fs", self.address, code.name,
                             e.details(), delay)
            else:
                if isinstance(reply, JoinInfo):
                    info = reply
                    break
                if reply.need_init:
                    split = SyncConfig.from_json(reply.config_json).split_tensors if reply.config_json else False
                    self._initialise(request, initial(reply.fragments, split), upload)
                    continue  # join again, now to receive the model
                # another learner uploads the initial model: the syncer answers, so this wait is not a timeout
                deadline = time.monotonic() + self.connect_timeout
                log.info("waiting for learner %s to upload the initial model", reply.init_owner)
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)
        self.config, self.session = info.config, info.session
        self._received_data = self._reported_data = 0
        self.receiver.reset(info.fragments, keep_overlap=info.config.keep_overlap)
        heap.release_after(self._max_payload)  # the join's message buffers, freed but still held by the heap
        for name, target in (("sender", background(self._send_loop)), ("receiver", background(self._receive_loop)),
                             ("heartbeat", self._heartbeat_loop)):
            thread = threading.Thread(target=target, name=f"learner-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return info

    def _join_failed(self, e: grpc.RpcError, attempts: int, seconds: float) -> SyncerError:
        """The error once connect_timeout is spent, for what the last attempt said."""
        if e.code() == grpc.StatusCode.ALREADY_EXISTS:
            return SyncerError(f"syncer at {self.address} refused learner {shown(self.learner_id)}: {e.details()}")
        if self._answered:  # the syncer is there: the connection keeps breaking
            return SyncerError(
                f"lost the connection to the syncer at {self.address} while joining ({attempts} attempts over "
                f"{seconds:.0f}s, last: {e.details()}); the link is unreliable or down — check the network, or raise "
                f"connect_timeout / --connect-timeout")
        closed = "socket closed" in (e.details() or "").lower()  # what a TLS mismatch often looks like
        if closed and not self.tls:
            hint = ("; the syncer closed every connection at once, which is what a TLS syncer does to a plaintext "
                    "learner — a TLS problem: if the syncer uses TLS, pass --tls-ca (or --tls)")
        elif closed:
            hint = ("; the syncer closed every connection during the TLS handshake — a TLS/certificate problem: does it "
                    "require a client certificate (pass --tls-cert and --tls-key)? Check --tls-ca too")
        else:
            hint = "" if self.tls else "; if the syncer uses TLS, pass --tls-ca"
        return SyncerError(
            f"cannot reach the syncer at {self.address} after {attempts} attempts over "
            f"{self.connect_timeout:.0f}s ({e.details()}); start it with `diloco syncer --listen {self.address}` "
            f"or check the address, port and firewall" + hint)

    def _join_once(self, request: pb.JoinRequest, initial) -> JoinInfo | pb.JoinHeader:
        """One Join from scratch: the model (JoinInfo), or the header alone when the syncer has no model yet. The
        fragments the syncer marks as held are taken from `initial`, our own values, which our digests described."""
        self.bytes_sent += wire_size(request)
        progress = self._join_attempt = Progress(self.stall_timeout)
        header, assembler, fragments = None, Assembler(self._max_payload), []
        call = self.stub.Join(request)  # no deadline: the watchdog ends it only if it stalls
        try:
            with progress.watching(call):
                for reply in call:
                    self.bytes_received += wire_size(reply)
                    if reply.HasField("header"):
                        header, self._answered = reply.header, True
                        progress.total = header.total_bytes
                        progress.moved(0)
                        if header.need_init or header.init_wait:
                            call.cancel()
                            return header
                    elif reply.blob.held:
                        fragments.append(self._held(reply.blob, header, request, initial))
                    else:
                        progress.moved(len(reply.blob.data))
                        done = assembler.add(reply.blob)
                        if done is not None:
                            fragments.append((done.fragment, done.version, codec.decode(done.payload)))
        except Stalled:
            got = progress.describe() if header is not None else "nothing (not even the reply header)"
            raise SyncerError(f"join stalled: no data from the syncer at {self.address} for {self.stall_timeout:.0f} s "
                              f"after {got}; {SLOW}") from None
        if header is None or len(fragments) != header.fragments:
            raise SyncerError(f"incomplete join reply from {self.address}: got {len(fragments)} fragments")
        fragments.sort(key=lambda f: f[0])
        config = SyncConfig.from_json(header.config_json)
        start = header.start_position if header.HasField("start_position") else None
        if start is not None and not 1 <= start <= config.sync_every:
            raise SyncerError(f"the syncer at {self.address} sent push-schedule position {start}, outside 1..H = "
                              f"1..{config.sync_every}: it is faulty or not a diloco syncer of this version")
        return JoinInfo(config, header.session, fragments, header.data_position, start)

    def _held(self, blob: pb.Blob, header: pb.JoinHeader | None, request: pb.JoinRequest, initial):
        """(fragment, version, values) of a fragment the syncer says we hold: our own, checked to be what it means."""
        config = SyncConfig.from_json(header.config_json) if header is not None else None
        ours = initial(config.fragments, config.split_tensors) if config is not None else []
        if not request.held or blob.version != 0 or blob.fragment >= len(ours):  # P fragments, then buffers, static
            raise SyncerError(f"the syncer at {self.address} marked fragment {blob.fragment} (version {blob.version}) "
                              f"of {len(ours)} as already held, which this learner cannot be: it is faulty or not a "
                              f"diloco syncer of this version")
        values = ours.flat(blob.fragment)
        if values.numel() != blob.numel:
            raise SyncerError(f"the syncer at {self.address} marked fragment {blob.fragment} as held with {blob.numel} "
                              f"values, but it has {values.numel()} here: it is faulty or the models differ")
        return blob.fragment, 0, values

    def _metered(self, messages, progress: Progress, payload_bytes):
        """Yields `messages` as gRPC takes them to send: bytes and progress count then, not when they are built."""
        for message in messages:
            self.bytes_sent += wire_size(message)
            progress.moved(payload_bytes(message))
            yield message

    def _initialise(self, request: pb.JoinRequest, flats, upload: Furthest) -> None:
        """Upload this learner's parameters as the initial global model (the syncer gave us the lease). A broken
        connection starts it over after joining again, unless no attempt got further for stall_timeout: `upload`."""
        kept = {i for i in range(len(flats)) if self.keeps_initial(i)}

        def chunks():  # lazily: one fragment's encoding at a time, never a second copy of the whole model
            yield pb.InitChunk(request=request)
            for i in range(len(flats)):  # each flat is a fresh copy: sent from its own memory
                payload = codec.view_fp32(flats.flat(i)) if i in kept else codec.encode(torch.zeros(0), "fp32")
                for blob in blobs(i, 0, payload):
                    yield pb.InitChunk(blob=blob)

        progress = Progress(self.stall_timeout, sum(codec.encoded_size(flats.layout[i].numel, "fp32") for i in kept))
        log.info("uploading the initial model (%s) to the syncer at %s", megabytes(progress.total), self.address)
        call = self.stub.Init.future(self._metered(chunks(), progress, lambda m: len(m.blob.data)))
        try:
            with progress.watching(call):
                call.result()
        except Stalled:
            raise SyncerError(f"init stalled: nothing moved to or from the syncer at {self.address} for "
                              f"{self.stall_timeout:.0f} s after {progress.describe()} of the initial model; {SLOW}") from None
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:  # the lease passed on
                log.info("upload of the initial model ended (%s); joining again", e.details())
                return
            if e.code() in RETRYABLE:
                if upload.broke(progress):
                    raise SyncerError(f"init stalled: the upload of the initial model to the syncer at {self.address} "
                                      f"{upload.describe(progress.total, e)}; {SLOW}") from None
                log.warning("the upload of the initial model broke after %s (%s: %s); joining again to start over",
                            progress.describe(), e.code().name, e.details())
                return
            raise SyncerError(f"syncer at {self.address} refused the initial model from learner "
                              f"{shown(request.learner_id)}: {e.details()}") from None

    # ---- background threads -------------------------------------------------------------------------------
    def _enqueue(self, job: PushJob) -> None:
        ticket = next(self._tickets)
        self._undelivered[ticket] = job
        self._pushes.put((ticket, job))

    def _send_loop(self) -> None:
        try:
            self._send_all()
        except Exception as e:  # a bug, not the network: say so rather than leave pushes queued silently
            log.exception("the push sender stopped")
            self._fail(f"the push sender stopped: {e!r}")

    def _send_all(self) -> None:
        while True:
            item = self._pushes.get()
            if item is None or self._closing.is_set():
                return
            ticket, job = item
            payload = job.payload(self.config.codec, self._ef if self.config.error_feedback else None)
            reply = self._deliver(job, payload)
            heap.release_after(4 * payload.numel)
            if reply is None:  # failed for good, or shutting down: the push stays undelivered
                return
            del self._undelivered[ticket]
            self._stop_requested |= reply.stop
            if not reply.accepted:
                log.warning("syncer refused fragment %d: %s", job.fragment, reply.reason)

    def _deliver(self, job: PushJob, payload: codec.Encoded) -> pb.PushReply | None:
        """Push until the syncer answers, with the same seq on every retry (the syncer merges a push at most once);
        None when it failed for good or the transport is closing."""
        delay = 0.2
        while not self._closing.is_set():
            try:
                return self._push_once(job, payload)
            except Stalled as e:
                log.warning("push of fragment %d stalled: %s; %s; retrying", job.fragment, e, SLOW)
            except grpc.FutureCancelledError:  # cancelled by close()
                return None
            except grpc.RpcError as e:
                if self._closing.is_set():
                    return None
                if e.code() not in RETRYABLE:
                    self._fail(f"push of fragment {job.fragment} failed: {e.details()}")
                    return None
            except ValueError:  # the channel was closed under us: only a shutdown does that
                if self._closing.is_set():
                    return None
                raise
            self._closing.wait(delay)
            delay = min(delay * 2, MAX_BACKOFF)
        return None

    def _push_once(self, job: PushJob, payload: codec.Encoded) -> pb.PushReply:
        header = pb.PushHeader(learner_id=self.learner_id, session=self.session, seq=job.seq, fragment=job.fragment,
                               base_version=job.base_version, steps=job.steps, tokens=job.tokens,
                               data_position=job.data_position, final=job.final)
        progress = self._push_progress = Progress(self.stall_timeout, len(payload.data))
        call = self._push_call = self.stub.Push.future(
            self._metered(push_chunks(header, payload, self.config.wire_compression), progress, lambda m: len(m.data)))
        if self._closing.is_set():  # close() may have looked for a call to cancel just before this one began
            call.cancel()
        with progress.watching(call):
            reply = call.result()
        self.bytes_received += wire_size(reply)
        self._answered_at = time.monotonic()
        return reply

    def _receive_loop(self) -> None:
        delay, broken = 0.2, False
        while not self._closing.is_set():
            assembler = Assembler(self._max_payload)
            try:
                self._subscription = self.stub.Subscribe(pb.SubscribeRequest(learner_id=self.learner_id, session=self.session))
                if broken:  # the syncer may have restarted and lost pushes it had not merged yet
                    broken = False
                    self._resend_inflight()
                for blob in self._subscription:
                    self.bytes_received += wire_size(blob)
                    self._received_data += len(blob.data)
                    if self._received_data - self._reported_data >= REPORT_BYTES:
                        self._report_due.set()
                    done = assembler.add(blob)
                    if done is not None and self._inflight.get(done.fragment) is not None \
                            and self._inflight[done.fragment].seq == done.seq:
                        del self._inflight[done.fragment]
                    if done is not None and not self.receiver.accept(done, done.refused):
                        self._fail(f"fragment {done.fragment} v{done.version} does not match the syncer's record of "
                                   f"what this learner holds; restart the learner to re-join")
                        return
                    if done is not None:
                        heap.release_after(4 * done.payload.numel)
                    delay = 0.2
                if self._closing.is_set():
                    return
            except grpc.RpcError as e:
                if self._closing.is_set() or e.code() == grpc.StatusCode.CANCELLED:
                    return
                if e.code() not in RETRYABLE:
                    # refused by a credential (revoked): the syncer's words say it all; otherwise a likely cause
                    hint = "" if e.code() == grpc.StatusCode.PERMISSION_DENIED else \
                        " (was it restarted without its --state directory?)"
                    self._fail(f"the syncer ended this learner's updates: {e.details()}{hint}")
                    return
                broken = True
            except codec.CorruptPayload as e:
                log.warning("damaged fragment from syncer (%s); resubscribing", e)
            except ValueError:  # the channel was closed under us (between the check above and Subscribe): a shutdown
                if self._closing.is_set():
                    return
                raise
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)

    def _resend_inflight(self) -> None:
        """Queue again the pushes whose merged result has not arrived, unless still queued: one copy each, however
        often the update stream reconnects during an outage."""
        queued = {(job.fragment, job.seq) for job in self._undelivered.copy().values()}
        for job in list(self._inflight.values()):
            if (job.fragment, job.seq) not in queued:
                self._enqueue(job)

    def _heartbeat_loop(self) -> None:
        sent_at = 0.0
        while True:
            # every heartbeat_seconds, and early when the update stream has news to report (not more often than
            # every EARLY_REPORT_SECONDS)
            self._report_due.wait(self.config.heartbeat_seconds)
            self._report_due.clear()
            if self._closing.wait(max(0.0, sent_at + EARLY_REPORT_SECONDS - time.monotonic())):
                return
            sent_at = time.monotonic()
            received = self._received_data
            request = pb.HeartbeatRequest(learner_id=self.learner_id, session=self.session, received_bytes=received,
                                          **self._progress)
            try:
                reply = self.stub.Heartbeat(request, timeout=max(2.0, 4 * self.config.heartbeat_seconds))
                self.bytes_sent += wire_size(request)
                self.bytes_received += wire_size(reply)
                self._stop_requested |= reply.stop
                self._budget_progress = reply.budget_progress if reply.HasField("budget_progress") else None
                self._phase_lead = reply.phase_lead if reply.HasField("phase_lead") else None
                self._reported_data = received
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    self._fail(f"heartbeat refused: {e.details()}")
                    return
                log.debug("heartbeat failed: %s", e.code().name)
            except ValueError:  # the channel was closed under us: only a shutdown does that
                if self._closing.is_set():
                    return
                raise

    def _fail(self, message: str) -> None:
        log.error(message)
        if self.error is None:  # the first is the cause; the other threads then fail the same way
            self.error = SyncerError(message)

    # ---- Transport interface ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the error that ended this transport, if one did."""
        if self.error is not None:
            raise self.error

    def push(self, job: PushJob) -> None:
        self.check()
        self._inflight[job.fragment] = job
        self._enqueue(job)

    def arrivals(self, timeout: float | None = None) -> list[Arrival]:
        self.check()
        return self.receiver.drain(timeout)

    def report(self, **progress) -> None:
        self._progress = {k: v for k, v in progress.items() if v is not None}

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def wire_bytes(self) -> int:
        return self.bytes_sent + self.bytes_received

    @property
    def undelivered(self) -> int:
        """Pushes queued or being sent: not yet answered by the syncer."""
        return len(self._undelivered)

    def close(self, timeout: float | None = 300.0) -> None:
        """Deliver every queued push (each answered by the syncer: accepted, refused or duplicate), say goodbye and
        stop the threads. Waits at most `timeout` seconds, or with None as long as pushes keep moving (at most
        stall_timeout without progress). Pushes still undelivered then make it raise SyncerError, after shutting
        down all the same. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        lost = self._await_delivery(timeout)
        self._shutdown()
        if not lost:
            return
        pushes = f"{len(lost)} push{'es' if len(lost) > 1 else ''} not delivered"
        fragments = [job.fragment for job in lost]
        if self.error is not None:
            raise SyncerError(f"finish: {pushes} (fragments {fragments}): {self.error}")
        within = f"within {timeout:.0f} s" if timeout is not None else f"(nothing moved for {self.stall_timeout:.0f} s)"
        raise SyncerError(
            f"finish: {pushes} {within} (fragments {fragments}); the syncer is unreachable "
            f"or the link is too slow — their progress is not in the global model; check the syncer and the link, "
            f"or allow more time (close(timeout=...); None waits as long as pushes make progress)")

    def _await_delivery(self, timeout: float | None) -> list[PushJob]:
        """Waits until the syncer answered every queued push; returns those it did not (in push order)."""
        started = time.monotonic()
        sender = self._threads[0] if self._threads else None
        while self._undelivered and sender is not None and sender.is_alive():
            now = time.monotonic()
            if timeout is not None and now - started >= timeout:
                break
            if timeout is None and now - self._last_push_movement(started) > self.stall_timeout:
                break
            time.sleep(0.05)
        return sorted(self._undelivered.copy().values(), key=lambda job: job.seq)

    def _last_push_movement(self, floor: float) -> float:
        current = self._push_progress
        return max(floor, self._answered_at, current.last if current is not None else floor)

    def _shutdown(self) -> None:
        self._closing.set()  # stops the sender's retries and the heartbeats
        self._report_due.set()  # wakes the heartbeat thread to see it
        call = self._push_call
        if call is not None:
            call.cancel()
        self._pushes.put(None)
        if self._threads:  # joined: a last heartbeat so the ledger has the final counts, then leave
            self._threads[0].join(5)
            self._goodbye()
        if self._subscription is not None:
            self._subscription.cancel()
        self.channel.close()  # ends every call still in flight, so the threads return promptly
        # a daemon thread still inside gRPC when the interpreter exits can abort the process ("terminate called
        # without an active exception"), so they are joined, not left behind
        for thread in self._threads:
            thread.join(self.rpc_timeout + 5)
            if thread.is_alive():
                log.warning("transport thread %s did not stop within %.0f s", thread.name, self.rpc_timeout + 5)

    def _goodbye(self) -> None:
        calls = [(self.stub.Leave, pb.LeaveRequest(learner_id=self.learner_id, session=self.session))]
        if self._progress:
            calls.insert(0, (self.stub.Heartbeat, pb.HeartbeatRequest(learner_id=self.learner_id, session=self.session,
                                                                      **self._progress)))
        for call, request in calls:
            try:
                call(request, timeout=self.rpc_timeout)
            except grpc.RpcError:
                pass
