"""The syncer's gRPC service (grpc.aio): turns RPCs into SyncerCore calls and publications into streams.

Threading: the event loop serves RPCs; every SyncerCore call runs on one worker thread (`_core`), so the core is
single-threaded and a long merge never stalls heartbeats or transfers.
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
    def __init__(self, core: SyncerCore, metrics: SyncerMetrics, token: str | None = None):
        self.core = core
        self.metrics = metrics
        self.token = token
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncer-core")
        self._queues: dict[str, asyncio.Queue[Publication | None]] = {}
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

    # ---- RPCs ---------------------------------------------------------------------------------------------
    async def Join(self, request, context):
        self._count_in(request)
        await self._check_token(context, request.token)
        try:
            check_learner_id(request.learner_id)
        except Refused as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        specs = specs_from_proto(request.specs)
        if not self.core.initialized:
            yield self._count_out(pb.JoinReply(header=pb.JoinHeader(need_init=True, fragments=self.core.cfg.fragments,
                                                                    config_json=self.core.cfg.to_json())))
            return
        try:
            session = await self._core(self.core.join, request.learner_id, specs)
        except Refused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        record = self.core.learners[request.learner_id]
        old = self._queues.get(request.learner_id)
        if old is not None:
            old.put_nowait(None)  # ends the previous session's stream
        self._queues[request.learner_id] = asyncio.Queue()
        log.info("learner %s joined (session %s)", request.learner_id, session)
        header = pb.JoinHeader(session=session, config_json=self.core.cfg.to_json(), fragments=len(self.core.fragments),
                               data_position=record.data_position)
        yield self._count_out(pb.JoinReply(header=header))
        for index, version, values in await self._core(self.core.snapshot_for_join, request.learner_id):
            for blob in blobs(index, version, codec.encode(values, "fp32")):
                yield self._count_out(pb.JoinReply(blob=blob))
        self.wake.set()

    async def Init(self, request_iterator, context):
        first, flats, assembler = None, {}, Assembler()
        async for chunk in request_iterator:
            self._count_in(chunk)
            if chunk.HasField("request"):
                first = chunk.request
                await self._check_token(context, first.token)
                continue
            try:
                done = assembler.add(chunk.blob)
                if done is not None:
                    flats[done.fragment] = codec.decode(done.payload)
            except codec.CorruptPayload as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"initial parameters damaged: {e}")
        if first is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Init must start with the learner's JoinRequest")
        try:
            ordered = [flats[i] for i in range(len(flats))]
            adopted = await self._core(self.core.initialize, specs_from_proto(first.specs), ordered)
        except (Refused, KeyError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot initialise the global model: {e}")
        if adopted:
            log.info("global model initialised from learner %s (%d fragments)", first.learner_id, len(self.core.fragments))
        return self._count_out(pb.InitReply())

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
        while True:
            item = await queue.get()
            if item is None:
                return
            pub, refused = item if isinstance(item, tuple) else (item, "")
            for blob in blobs(pub.fragment, pub.version, pub.payload, pub.full, pub.result_checksum, refused, pub.seq):
                yield self._count_out(blob)

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
