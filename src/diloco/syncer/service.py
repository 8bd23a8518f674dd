"""The syncer's gRPC service (grpc.aio): turns RPCs into SyncerCore calls and publications into streams.

Threading: the event loop serves RPCs; every SyncerCore call runs on one worker thread (`_core`), so the core is
single-threaded and a long merge never stalls heartbeats or transfers. The service's own state (update queues, open
update streams, the initial-upload lease) is touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from diloco import codec
from diloco.syncer.core import Publication, Refused, SyncerCore, check_learner_id
from diloco.syncer.metrics import SyncerMetrics
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import Assembler, blobs, specs_from_proto, wire_size

log = logging.getLogger("diloco.syncer")


class SyncerService(pb_grpc.SyncerServicer):
    def __init__(self, core: SyncerCore, metrics: SyncerMetrics, token: str | None = None, stall_timeout: float = 60.0):
        """`stall_timeout`: seconds the learner uploading the initial model may send nothing before another joiner
        takes the upload over."""
        self.core = core
        self.metrics = metrics
        self.token = token
        self.stall_timeout = stall_timeout
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncer-core")
        self._queues: dict[str, asyncio.Queue[Publication | None]] = {}
        self._streams: dict[tuple[str, str], int] = {}
        """Open Subscribe streams per (learner, session): a learner with one open is connected to this syncer."""
        self._init_owner: str | None = None
        """The learner allowed to upload the initial model (the lease), while the syncer has none."""
        self._init_lease = 0
        """Counts lease grants: an Init runs under the grant current at its start and ends when it is superseded."""
        self._init_active_at = 0.0
        """When the lease owner last made progress (the grant, or an Init chunk received)."""
        self.wake = asyncio.Event()

    async def _core(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def _count_in(self, message) -> None:
        self.metrics.wire_bytes.labels("received").inc(wire_size(message))

    def _count_out(self, message):
        self.metrics.wire_bytes.labels("sent").inc(wire_size(message))
        return message

    async def _check_token(self, context, token: str) -> None:
        if self.token and not hmac.compare_digest(self.token.encode(), token.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing run token: pass the syncer's --token")

    def _queue(self, learner_id: str) -> asyncio.Queue:
        """The learner's update queue; created on demand for learners restored from saved state."""
        return self._queues.setdefault(learner_id, asyncio.Queue())

    def deliver(self, publications: list[Publication]) -> None:
        for pub in publications:
            self._queue(pub.learner).put_nowait(pub)
        if publications:
            self.metrics.observe_rounds(self.core)

    # ---- membership ---------------------------------------------------------------------------------------
    def _live_for(self, learner_id: str) -> float | None:
        """Seconds since `learner_id` joined if its current session is live here (its update stream is open and
        it was heard from within the absence timeout); None otherwise."""
        record = self.core.learners.get(learner_id)
        if record is None or record.left or not self._streams.get((learner_id, record.session)):
            return None
        now = self.core.clock()
        if now - record.last_seen > self.core.cfg.absent_after_seconds:
            return None  # hung or cut off: its stream may linger until keepalive notices
        return now - record.joined_at

    def _take_init_lease(self, learner_id: str) -> str:
        """The learner that uploads the initial model: the first joiner, until its upload fails or sends nothing
        for stall_timeout; then whoever joins next. Its owner re-joining keeps it. Returns the owner."""
        now = time.monotonic()
        owner = self._init_owner
        if owner is not None and owner != learner_id and now - self._init_active_at <= self.stall_timeout:
            return owner
        if owner is not None and owner != learner_id:
            log.warning("learner %s sent no initial parameters for %.0f s; learner %s uploads them instead",
                        owner, now - self._init_active_at, learner_id)
        self._init_owner, self._init_active_at = learner_id, now
        self._init_lease += 1
        return learner_id

    def _init_header(self, learner_id: str) -> pb.JoinHeader:
        owner = self._take_init_lease(learner_id)
        header = pb.JoinHeader(fragments=self.core.cfg.fragments, config_json=self.core.cfg.to_json(), init_owner=owner)
        if owner == learner_id:
            header.need_init = True
            log.info("asking learner %s for the initial model", learner_id)
        else:
            header.init_wait = True
        return header

    # ---- RPCs ---------------------------------------------------------------------------------------------
    async def Join(self, request, context):
        self._count_in(request)
        await self._check_token(context, request.token)
        try:
            check_learner_id(request.learner_id)
        except Refused as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            specs = specs_from_proto(request.specs)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad model description: {e}")
        if not self.core.initialized:
            yield self._count_out(pb.JoinReply(header=self._init_header(request.learner_id)))
            return
        live_for = self._live_for(request.learner_id)
        if live_for is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, (
                f"learner id {request.learner_id!r} is already live in this run (joined {live_for:.0f} s ago); every "
                f"learner needs its own id — or, in a torchrun job, create the Learner with process_group=... so "
                f"only one rank joins"))
        try:
            session = await self._core(self.core.join, request.learner_id, specs)
            snapshot = await self._core(self.core.snapshot_for_join, request.learner_id)
        except Refused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        record = self.core.learners[request.learner_id]
        old = self._queues.get(request.learner_id)
        if old is not None:
            old.put_nowait(None)  # ends the previous session's stream
        self._queues[request.learner_id] = asyncio.Queue()
        log.info("learner %s joined (session %s)", request.learner_id, session)
        total = sum(codec.encoded_size(values.numel(), "fp32") for _, _, values in snapshot)
        header = pb.JoinHeader(session=session, config_json=self.core.cfg.to_json(), fragments=len(snapshot),
                               data_position=record.data_position, total_bytes=total)
        yield self._count_out(pb.JoinReply(header=header))
        for index, version, values in snapshot:
            for blob in blobs(index, version, codec.encode(values, "fp32")):
                yield self._count_out(pb.JoinReply(blob=blob))
        self.wake.set()

    async def Init(self, request_iterator, context):
        first, lease = None, 0
        try:
            async for chunk in request_iterator:
                self._count_in(chunk)
                if first is None:  # checked before anything is buffered
                    first = await self._admit_init(chunk, context)
                    if self.core.initialized:
                        return self._count_out(pb.InitReply())  # another upload won: nothing to receive
                    lease, flats, assembler = self._init_lease, {}, Assembler()
                    self._init_active_at = time.monotonic()
                    continue
                if self.core.initialized:
                    return self._count_out(pb.InitReply())  # another upload won meanwhile: the rest is not needed
                await self._check_init_lease(first.learner_id, lease, context)
                self._init_active_at = time.monotonic()  # progress: the lease stays with this upload
                if not chunk.HasField("blob"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Init carries one JoinRequest, first")
                try:
                    done = assembler.add(chunk.blob)
                    if done is not None:
                        flats[done.fragment] = codec.decode(done.payload)
                except codec.CorruptPayload as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"initial parameters damaged: {e}")
            if first is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Init must start with the learner's JoinRequest")
            if self.core.initialized:
                return self._count_out(pb.InitReply())
            await self._check_init_lease(first.learner_id, lease, context)
            try:
                ordered = [flats[i] for i in range(len(flats))]
                adopted = await self._core(self.core.initialize, specs_from_proto(first.specs), ordered)
            except (Refused, KeyError, ValueError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot initialise the global model: {e}")
            if adopted:
                log.info("global model initialised from learner %s (%d fragments)", first.learner_id, len(self.core.fragments))
            return self._count_out(pb.InitReply())
        finally:
            if self.core.initialized:
                self._init_owner = None
            elif first is not None and self._init_lease == lease and self._init_owner == first.learner_id:
                log.warning("learner %s's upload of the initial model failed; the next joiner uploads it", first.learner_id)
                self._init_owner = None  # failed: the lease passes to the next joiner

    async def _admit_init(self, chunk, context) -> pb.JoinRequest:
        """The first Init chunk: the uploader's JoinRequest, with the run token, from the lease owner."""
        if not chunk.HasField("request"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Init must start with the learner's JoinRequest")
        await self._check_token(context, chunk.request.token)
        if not self.core.initialized:
            await self._check_init_lease(chunk.request.learner_id, self._init_lease, context)
        return chunk.request

    async def _check_init_lease(self, learner_id: str, lease: int, context) -> None:
        """Only the learner holding the current lease uploads; an Init whose lease passed on is ended."""
        if self._init_owner == learner_id and self._init_lease == lease:
            return
        if self._init_owner in (None, learner_id):
            why = "its upload lease was superseded or released"
        else:
            why = f"learner {self._init_owner} uploads it"
        await context.abort(grpc.StatusCode.ABORTED,
                            f"learner {learner_id!r} may not upload the initial model now ({why}); join again")

    async def Push(self, request_iterator, context):
        started = time.monotonic()
        header, parts = None, []
        async for chunk in request_iterator:
            self._count_in(chunk)
            if chunk.HasField("header"):
                header = chunk.header
                try:
                    limit = self.core.payload_limit(header.fragment, header.codec)
                except ValueError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                if header.total_bytes > limit:
                    self.metrics.refusals.labels("oversized").inc()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"push of {header.total_bytes} bytes for fragment {header.fragment} exceeds "
                                        f"its {limit}-byte size (wrong fragment, codec or model)")
            else:
                if header is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push data before its header")
                parts.append(chunk.data)
                if header is not None and sum(map(len, parts)) > header.total_bytes:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push payload longer than its header says")
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push without a header")
        payload = codec.Encoded(header.codec, header.numel, b"".join(parts), header.checksum)
        try:
            result = await self._core(
                self.core.push, header.learner_id, header.session, header.seq, header.fragment, header.base_version,
                header.steps, header.tokens, payload, header.data_position, time.monotonic() - started,
            )
        except Refused as e:
            self.metrics.refusals.labels("session").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if not result.accepted:
            self.metrics.refusals.labels(result.reason.split(":")[0][:40]).inc()
            log.warning("refused push of fragment %d from %s: %s", header.fragment, header.learner_id, result.reason)
        elif not result.duplicate:
            self.metrics.pushes.inc()
        if result.resync:  # refused, or merged before: the learner gets the current values
            pub = await self._core(self.core.resync, header.learner_id, header.session, header.fragment, header.seq)
            self._queue(header.learner_id).put_nowait((pub, "" if result.accepted else result.reason))
        self.wake.set()
        reply = pb.PushReply(accepted=result.accepted, reason=result.reason, duplicate=result.duplicate,
                             resync=result.resync, stop=self.core.should_stop())
        return self._count_out(reply)

    async def Subscribe(self, request, context):
        self._count_in(request)
        record = self.core.learners.get(request.learner_id)
        if record is None or record.session != request.session:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown learner or stale session: join again")
        queue = self._queue(request.learner_id)
        key = (request.learner_id, request.session)
        self._streams[key] = self._streams.get(key, 0) + 1
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                pub, refused = item if isinstance(item, tuple) else (item, "")
                for blob in blobs(pub.fragment, pub.version, pub.payload, pub.full, pub.result_checksum, refused, pub.seq):
                    yield self._count_out(blob)
        finally:  # also when the learner's connection ends (a crash): the id is free to join again
            self._streams[key] -= 1
            if not self._streams[key]:
                del self._streams[key]

    async def Heartbeat(self, request, context):
        self._count_in(request)
        progress = dict(
            step=request.step, tokens_trained=request.tokens_trained, data_position=request.data_position,
            pushes=request.pushes, applied=request.applied,
            loss=request.loss if request.HasField("loss") else None,
            step_seconds=request.step_seconds if request.HasField("step_seconds") else None,
            speed=request.speed if request.HasField("speed") else None,
            tokens_per_second=request.tokens_per_second if request.HasField("tokens_per_second") else None,
        )
        try:
            stop = await self._core(self.core.heartbeat, request.learner_id, request.session, **progress)
        except Refused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        lead = await self._core(self.core.phase_lead, request.learner_id)
        self.wake.set()
        return self._count_out(pb.HeartbeatReply(stop=stop, tokens_trained=self.core.tokens_trained(),
                                                 budget_progress=self.core.budget_progress(), phase_lead=lead))

    async def Leave(self, request, context):
        self._count_in(request)
        try:
            await self._core(self.core.leave, request.learner_id, request.session)
        except Refused:
            pass  # leaving twice, or after a re-join elsewhere, is harmless
        log.info("learner %s left", request.learner_id)
        self.wake.set()
        return self._count_out(pb.LeaveReply())

    # ---- rounds -------------------------------------------------------------------------------------------
    async def run_rounds(self, stop: asyncio.Event) -> None:
        """Close rounds when the policy says so: after each request, and at the times it asks to be woken."""
        while not stop.is_set():
            publications = await self._core(self.core.poll)
            self.deliver(publications)
            wake_at = await self._core(self.core.next_wakeup)
            timeout = None if wake_at is None else max(0.0, wake_at - self.core.clock())
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=min(timeout, 1.0) if timeout is not None else 1.0)
            except asyncio.TimeoutError:
                pass

    async def drain(self) -> None:
        """At shutdown: merge whatever is pending and send it out."""
        self.deliver(await self._core(self.core.poll, True))
        for queue in self._queues.values():
            queue.put_nowait(None)
