"""The learner's connection to a remote syncer: gRPC calls on background threads, with retries and backoff.

Threads: `sender` encodes and pushes outer gradients in order; `receiver` holds the Subscribe stream and
reassembles merged fragments; `heartbeat` reports progress and learns when the run is over. The training thread
only enqueues pushes and drains arrivals.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from diloco import codec
from diloco.config import SyncConfig
from diloco.fragments import TensorSpec
from diloco.learner.transport import Arrival, HeartbeatNews, JoinInfo, PushJob, Receiver, SyncerError
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import GRPC_OPTIONS, Assembler, blobs, push_chunks, specs_to_proto, wire_size
from diloco.wire.tls import channel_credentials

log = logging.getLogger("diloco.learner")
MAX_BACKOFF = 2.0  # seconds between retries at most: a returning syncer is noticed within about that
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


class GrpcTransport(HeartbeatNews):
    """Connects a Learner to `diloco syncer` at `address` ("host:port")."""

    def __init__(self, address: str, token: str = "", connect_timeout: float = 30.0, rpc_timeout: float = 60.0,
                 tls: bool = False, tls_ca=None, tls_cert=None, tls_key=None):
        """`tls` (or any tls_* file) connects with TLS, trusting `tls_ca` or the system's roots; `tls_cert` and
        `tls_key` present a client certificate to a syncer that requires one."""
        self.address = address
        self.token = token
        self.connect_timeout = connect_timeout
        self.rpc_timeout = rpc_timeout
        self.tls = bool(tls or tls_ca or tls_cert or tls_key)
        self.channel = (grpc.secure_channel(address, channel_credentials(tls_ca, tls_cert, tls_key), options=GRPC_OPTIONS)
                        if self.tls else grpc.insecure_channel(address, options=GRPC_OPTIONS))
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.receiver = Receiver()
        self.error: SyncerError | None = None
        self.bytes_sent = self.bytes_received = 0
        self._pushes: queue.Queue[PushJob | None] = queue.Queue()
        self._closing = threading.Event()
        self._stop_requested = False
        self._progress: dict = {}
        self._threads: list[threading.Thread] = []
        self._subscription = None
        self._ef = codec.ErrorFeedback()
        self._inflight: dict[int, PushJob] = {}
        """Pushes whose merged result has not arrived: re-sent (same seq) after the update stream reconnects."""

    # ---- joining ------------------------------------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], initial) -> JoinInfo:
        self.learner_id = learner_id
        deadline, delay, attempts = time.monotonic() + self.connect_timeout, 0.2, 0
        while True:
            attempts += 1
            try:
                info = self._join_once(learner_id, specs, initial)
                break
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise SyncerError(f"syncer at {self.address} refused learner {learner_id!r}: {e.details()}") from None
                if time.monotonic() + delay > deadline:
                    raise SyncerError(
                        f"cannot reach the syncer at {self.address} after {attempts} attempts over "
                        f"{self.connect_timeout:.0f}s ({e.details()}); start it with `diloco syncer --listen {self.address}` "
                        f"or check the address, port and firewall"
                        + ("" if self.tls else "; if the syncer uses TLS, pass --tls-ca")
                    ) from None
                log.info("syncer at %s not reachable yet (%s); retrying in %.1fs", self.address, e.code().name, delay)
                time.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)
        self.config, self.session = info.config, info.session
        self.receiver.reset(info.fragments)
        for name, target in (("sender", self._send_loop), ("receiver", self._receive_loop), ("heartbeat", self._heartbeat_loop)):
            thread = threading.Thread(target=target, name=f"learner-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return info

    def _join_once(self, learner_id, specs, initial) -> JoinInfo:
        request = pb.JoinRequest(learner_id=learner_id, specs=specs_to_proto(specs), token=self.token)
        self.bytes_sent += wire_size(request)
        header, assembler, fragments = None, Assembler(), []
        for reply in self.stub.Join(request, timeout=self.rpc_timeout):
            self.bytes_received += wire_size(reply)
            if reply.HasField("header"):
                header = reply.header
                if header.need_init:
                    self._initialise(request, initial(header.fragments))
                    return self._join_once(learner_id, specs, initial)
            else:
                done = assembler.add(reply.blob)
                if done is not None:
                    fragments.append((done.fragment, done.version, codec.decode(done.payload)))
        if header is None or len(fragments) != header.fragments:
            raise SyncerError(f"incomplete join reply from {self.address}: got {len(fragments)} fragments")
        fragments.sort(key=lambda f: f[0])
        return JoinInfo(SyncConfig.from_json(header.config_json), header.session, fragments, header.data_position)

    def _initialise(self, request: pb.JoinRequest, flats) -> None:
        def chunks():
            yield pb.InitChunk(request=request)
            for i, flat in enumerate(flats):
                for blob in blobs(i, 0, codec.encode(flat, "fp32")):
                    yield pb.InitChunk(blob=blob)

        messages = list(chunks())
        self.bytes_sent += sum(map(wire_size, messages))
        self.stub.Init(iter(messages), timeout=self.rpc_timeout)

    # ---- background threads -------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            job = self._pushes.get()
            if job is None:
                return
            payload = (self._ef.encode(job.fragment, job.delta, self.config.codec) if self.config.error_feedback
                       else codec.encode(job.delta, self.config.codec))
            header = pb.PushHeader(learner_id=self.learner_id, session=self.session, seq=job.seq, fragment=job.fragment,
                                   base_version=job.base_version, steps=job.steps, tokens=job.tokens,
                                   data_position=job.data_position)
            messages = list(push_chunks(header, payload))
            delay = 0.2
            while True:  # the same seq on every retry: the syncer merges a push at most once
                try:
                    reply = self.stub.Push(iter(messages), timeout=self.rpc_timeout)
                    self.bytes_sent += sum(map(wire_size, messages))
                    self.bytes_received += wire_size(reply)
                    break
                except grpc.RpcError as e:
                    if e.code() not in RETRYABLE or self._closing.is_set():
                        self._fail(f"push of fragment {job.fragment} failed: {e.details()}")
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, MAX_BACKOFF)
            self._stop_requested |= reply.stop
            if not reply.accepted:
                log.warning("syncer refused fragment %d: %s", job.fragment, reply.reason)

    def _receive_loop(self) -> None:
        delay, broken = 0.2, False
        while not self._closing.is_set():
            assembler = Assembler()
            try:
                self._subscription = self.stub.Subscribe(pb.SubscribeRequest(learner_id=self.learner_id, session=self.session))
                if broken:  # the syncer may have restarted and lost pushes it had not merged yet
                    broken = False
                    for job in list(self._inflight.values()):
                        self._pushes.put(job)
                for blob in self._subscription:
                    self.bytes_received += wire_size(blob)
                    done = assembler.add(blob)
                    if done is not None and self._inflight.get(done.fragment) is not None \
                            and self._inflight[done.fragment].seq == done.seq:
                        del self._inflight[done.fragment]
                    if done is not None and not self.receiver.accept(done, done.refused):
                        self._fail(f"fragment {done.fragment} v{done.version} does not match the syncer's record of "
                                   f"what this learner holds; restart the learner to re-join")
                        return
                    delay = 0.2
                if self._closing.is_set():
                    return
            except grpc.RpcError as e:
                if self._closing.is_set() or e.code() == grpc.StatusCode.CANCELLED:
                    return
                if e.code() not in RETRYABLE:
                    self._fail(f"the syncer ended this learner's updates: {e.details()} (was it restarted without "
                               f"its --state directory?)")
                    return
                broken = True
            except codec.CorruptPayload as e:
                log.warning("damaged fragment from syncer (%s); resubscribing", e)
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)

    def _heartbeat_loop(self) -> None:
        while not self._closing.wait(self.config.heartbeat_seconds):
            request = pb.HeartbeatRequest(learner_id=self.learner_id, session=self.session, **self._progress)
            try:
                reply = self.stub.Heartbeat(request, timeout=max(2.0, 4 * self.config.heartbeat_seconds))
                self.bytes_sent += wire_size(request)
                self.bytes_received += wire_size(reply)
                self._stop_requested |= reply.stop
                self._budget_progress = reply.budget_progress if reply.HasField("budget_progress") else None
                self._phase_lead = reply.phase_lead if reply.HasField("phase_lead") else None
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
        self.error = SyncerError(message)

    # ---- Transport interface ------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def push(self, job: PushJob) -> None:
        self._check()
        self._inflight[job.fragment] = job
        self._pushes.put(job)

    def arrivals(self, timeout: float | None = None) -> list[Arrival]:
        self._check()
        return self.receiver.drain(timeout)

    def report(self, **progress) -> None:
        self._progress = {k: v for k, v in progress.items() if v is not None}

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def wire_bytes(self) -> int:
        return self.bytes_sent + self.bytes_received

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, say goodbye, and stop the threads."""
        self._pushes.put(None)
        if self._threads:
            self._threads[0].join(timeout)
        if self._progress:  # a last heartbeat so the ledger has the final counts
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(learner_id=self.learner_id, session=self.session, **self._progress), timeout=5)
            except grpc.RpcError:
                pass
        self._closing.set()
        try:
            self.stub.Leave(pb.LeaveRequest(learner_id=self.learner_id, session=getattr(self, "session", "")), timeout=5)
        except grpc.RpcError:
            pass
        if self._subscription is not None:
            self._subscription.cancel()
        for thread in self._threads[1:]:
            thread.join(5)
        self.channel.close()
