"""The syncer's gRPC service (grpc.aio): turns RPCs into SyncerCore calls and publications into streams.

Threading (docs/architecture.md, Threading model): the event loop serves RPCs; every SyncerCore call that changes
rounds, fragments or the set of learners runs on one worker thread (`_core`), one at a time. Heartbeats, leaves and
status run on a second thread (`_ledger`) and take only the core's lock, which the worker holds for bookkeeping and
never across a merge, so a long merge does not delay them. Large copies (a join's encoding, a push's payload) run off
the event loop too. The service's own state (update queues, open update streams, the initial-upload lease) is
touched only on the event loop.

Untrusted input: every request is checked here before the core sees it (wire/bounds.py): counters within bounds,
floats finite, a push authenticated by its learner's session and sized before any of its data is buffered, client
streams that send nothing for `stall_timeout` ended. Whatever a request holds, the answer is a status naming what
was wrong (INVALID_ARGUMENT, UNAUTHENTICATED, FAILED_PRECONDITION), never UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc.aio import AbortError

from diloco import allocator
from diloco.algorithm import codec
from diloco.algorithm.digest import check_held, held_fragments
from diloco.syncer.observation import memory
from diloco.syncer.core import Refused, SyncerCore
from diloco.syncer.serving.rpc_errors import ShuttingDown, guarded, short
from diloco.syncer.defences.heartbeat_budget import HeartbeatBudget
from diloco.syncer.at_rest.initial_model import InitialModelFile
from diloco.syncer.serving.admission import Admission
from diloco.syncer.serving.initial_upload import IDLE, InitialUpload
from diloco.syncer.defences.join_refusals import JoinRefusals
from diloco.syncer.serving.push_budget import PushBudget
from diloco.syncer.serving.update_streams import MAX_STREAMS, SEND_TURNS, UpdateStreams
from diloco.syncer.serving.send_window import DEFAULT_BYTES as DEFAULT_SEND_WINDOW, SendWindow
from diloco.syncer.serving.serialized_updates import SerializedUpdates
from diloco.syncer.updates import UpdateQueue
from diloco.syncer.observation.metrics import SyncerMetrics
from diloco.wire import diloco_pb2 as pb
from diloco.wire import bounds
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.bounds import shown
from diloco.wire.compression import unpack
from diloco.wire.messages import blobs, specs_from_proto

log = logging.getLogger("diloco.syncer")
EXPIRY_SECONDS = 10.0
"""How often departed learners' records are looked at for expiry (SyncerCore.expire)."""
ABSENCE_CHECK_SECONDS = 0.5
"""How often learners are looked at for a new absence, which is logged (SyncerCore.note_absences)."""


class SyncerService(Admission, InitialUpload, UpdateStreams, pb_grpc.SyncerServicer):
    def __init__(self, core: SyncerCore, metrics: SyncerMetrics, token: str | None = None, stall_timeout: float = 60.0,
                 allow_takeover: bool = False, initial_model: InitialModelFile | None = None, credentials=None,
                 client_cert_ids: bool = False, push_buffer_share: float = 0.25,
                 send_window: int = DEFAULT_SEND_WINDOW):
        """`stall_timeout`: seconds the learner uploading the initial model may send nothing before another joiner
        takes the upload over; also how long any client stream (Init, Push) may send nothing before it is ended.
        `allow_takeover`: a Join under a live id supersedes it without that learner's session secret.
        `initial_model`: the initial global model from a file (--initial-model): no learner uploads it.
        `credentials`: per-learner credentials (`syncer.credentials.Credentials`, --credentials): a listed id joins
        with its own token only. `client_cert_ids`: under mutual TLS, a learner's client certificate names its id
        (its common name) and is its credential. `push_buffer_share`: payload bytes of pushes held at once, as a share
        of the model's fp32 size (0: no bound; syncer/serving/push_budget.py). `send_window`: bytes an update stream
        may write beyond what its learner reports it received (0: no bound; syncer/serving/send_window.py)."""
        self.core = core
        self.send_window = send_window
        self.push_buffer_share = push_buffer_share
        self.push_budget = PushBudget()
        self.credentials = credentials
        self.client_cert_ids = client_cert_ids
        self.heartbeats = HeartbeatBudget()
        """Heartbeats answered per credential and in total (syncer/defences/heartbeat_budget.py)."""
        self._push_streams: dict[str, int] = {}
        """Push streams open per learner."""
        self.metrics = metrics
        self.token = token
        self.stall_timeout = stall_timeout
        self.allow_takeover = allow_takeover
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncer-core")
        self._ledger_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncer-ledger")
        self._submitted = 0
        """Calls handed to the core worker (written on the event loop only)."""
        self._started = 0
        """Calls the core worker began (written on the worker only): _submitted − _started are waiting."""
        self.annotations = None
        """Held-out losses and faults posted to the HTTP server (`annotations.Annotations`), shown in the status."""
        self.loop_lag = {"last": 0.0, "max": 0.0}
        """How late a 0.1 s sleep on the event loop woke up, latest and largest (`watch_loop_lag`)."""
        core.on_merge = metrics.merge_seconds.observe
        core.on_event = metrics.observe_event
        metrics.core_queue.set_function(self.core_queue_depth)
        self._queues: dict[str, UpdateQueue] = {}
        self._streams: dict[tuple[str, str], int] = {}
        """Open Subscribe streams per (learner, session): a learner with one open is connected to this syncer."""
        self.send_turns = asyncio.Semaphore(SEND_TURNS)
        """Update chunks whose writes may start in one turn of the event loop (syncer/serving/update_streams.py)."""
        self.serialized_updates = SerializedUpdates()
        """Update chunks serialized once for every stream (syncer/serving/serialized_updates.py)."""
        self._sending: dict[object, object] = {}
        """The payload each Subscribe stream is sending now (by a key of its own), taken off its queue."""
        self._windows: dict[tuple[str, str], SendWindow] = {}
        """Per (learner, session) with an update stream open: how far its streams may run ahead of its learner."""
        self._init_owner: str | None = None
        """The learner allowed to upload the initial model (the lease), while the syncer has none."""
        self._init_lease = 0
        """Counts lease grants: an Init runs under the grant current at its start and ends when it is superseded."""
        self._init_active_at = 0.0
        """When the lease owner last made progress (the grant, or an Init chunk received)."""
        self._initial_file = None if core.initialized else initial_model
        self._initial_digests: dict[str, bytes] = {}
        """Digests of the initial model by tensor name, while this process has them (a joiner holding the same
        values is not sent the fragments still at version 0): empty after a restart from --state."""
        self.wake = asyncio.Event()
        self._samples: dict[str, tuple[str, bounds.Sample]] = {}
        """Per learner: (session, its last accepted heartbeat counters), for the rate bound on them."""
        self._warned: set[tuple[str, str]] = set()
        self._join_refusals = JoinRefusals(log)

    async def _core(self, fn, *args, **kwargs):
        """Run a SyncerCore call (or anything touching its tensors) on the core worker, after those queued before."""
        def call():
            self._started += 1
            return fn(*args, **kwargs)

        self._submitted += 1
        return await self._run(self._pool, call)

    async def _ledger(self, fn, *args, **kwargs):
        """Run a light SyncerCore call (heartbeat, leave, status: the lock only) beside the core worker."""
        return await self._run(self._ledger_pool, lambda: fn(*args, **kwargs))

    @staticmethod
    async def _run(pool, call):
        try:
            future = asyncio.get_running_loop().run_in_executor(pool, call)
        except RuntimeError as e:  # the pool is shut down: the syncer is stopping
            raise ShuttingDown(str(e)) from None
        return await future

    def _push_bytes(self) -> PushBudget:
        """The push budget, its limit set from the model's size once there is a model."""
        if self.push_budget.limit is None and self.push_buffer_share > 0 and self.core.initialized:
            model_bytes = 4 * sum(fs.fragment.numel for fs in self.core.fragments)
            self.push_budget.set_limit(self.push_buffer_share * model_bytes)
        return self.push_budget

    def core_queue_depth(self) -> int:
        """Calls waiting for the core worker (not counting the one it runs)."""
        return max(0, self._submitted - self._started)

    def stats(self) -> dict:
        """The service's own figures for /status (beside SyncerCore.status)."""
        return {"core_queue": self.core_queue_depth(), "loop_lag_seconds": round(self.loop_lag["last"], 4),
                "loop_lag_max_seconds": round(self.loop_lag["max"], 4), "memory": self.memory(),
                "allocator": allocator.name(),
                "kept_payloads_on_disk": self.core.kept_payloads.on_disk}

    def memory(self) -> dict[str, int]:
        """Bytes the syncer holds by part (`syncer.memory`), and its RSS."""
        parts = memory.core_parts(self.core)
        kept = memory.kept_change_ids(self.core)
        parts["queued_answers"] = memory.queued_bytes(self._queues.values(), kept)
        parts["sending"] = memory.sending_bytes(list(self._sending.values()), self._queues.values(), kept)
        parts["receiving"] = self.push_budget.held
        parts["serialized_updates"] = self.serialized_updates.held
        return {**memory.with_heap(parts, allocator.heap()), "rss": memory.rss_bytes()}

    async def status(self) -> dict:
        """SyncerCore.status plus `stats`, without waiting for the core worker (a merge in progress)."""
        notes = self.annotations.status() if self.annotations is not None else {}
        return {**await self._ledger(self.core.status), **self.stats(), **notes}

    async def watch_loop_lag(self, interval: float = 0.1) -> None:
        """Measure, until cancelled, how late the event loop wakes from a sleep of `interval`: anything run on the
        loop for long (instead of on a worker) shows here, as a delay of every RPC."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(interval)
            lag = max(0.0, loop.time() - before - interval)
            self.loop_lag["last"] = lag
            self.loop_lag["max"] = max(self.loop_lag["max"], lag)
            self.metrics.loop_lag.observe(lag)

    def shutdown(self) -> None:
        """Stop the worker threads (after the calls queued on them)."""
        self._pool.shutdown(wait=True)
        self._ledger_pool.shutdown(wait=True)

    def _count_in(self, message, codec_name: str | None = None) -> None:
        self.metrics.count_message(message, "received", codec_name)

    async def _bad_input(self, context, rpc: str, e: BaseException) -> None:
        self.metrics.refused("bad input")
        text = short(str(e) or type(e).__name__)
        log.warning("refused a %s request: %s", rpc, text)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad {rpc} request: {text}")

    async def _refuse(self, context, code: grpc.StatusCode, label: str, message: str) -> None:
        self.metrics.refused(label)
        await context.abort(code, message)

    async def _chunks(self, request_iterator, context):
        """The client stream's messages, and IDLE each time none arrived for stall_timeout: the caller ends the
        stream then (`_idle`), so a slow or silent client cannot hold a stream and its buffers forever."""
        messages = request_iterator.__aiter__()
        while True:
            # the read is never cancelled (that would break the stream): an idle period leaves it pending
            read = asyncio.ensure_future(messages.__anext__())
            try:
                while not (await asyncio.wait({read}, timeout=self.stall_timeout))[0]:
                    yield IDLE
                try:
                    message = read.result()
                except StopAsyncIteration:
                    return
            finally:
                if not read.done():
                    read.cancel()  # the handler ended the stream while waiting
            yield message

    async def _idle(self, context, what: str, seconds: float) -> None:
        await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "idle stream",
                           f"{what}: nothing arrived for {seconds:.0f} s; the syncer ended the stream")

    # ---- membership ---------------------------------------------------------------------------------------
    def _live_for(self, learner_id: str) -> float | None:
        """Seconds since `learner_id` joined if its current session is live here (its update stream is open and
        it was heard from within the absence timeout); None otherwise."""
        record = self.core.learners.get(learner_id)
        if record is None or record.left or not self._streams.get((learner_id, record.session_hash)):
            return None
        now = self.core.clock()
        if now - record.last_seen > self.core.cfg.absent_after_seconds:
            return None  # hung or cut off: its stream may linger until keepalive notices
        return now - record.joined_at

    # ---- RPCs ---------------------------------------------------------------------------------------------
    @guarded
    async def Join(self, request, context):
        replies = self._join(request, context)
        try:
            async for reply in replies:
                yield reply
        except AbortError:
            if context.aborted is not None and context.aborted[0] != grpc.StatusCode.UNAVAILABLE:
                await self._refused_join(request.learner_id, context.aborted[1])
            raise
        finally:
            await replies.aclose()  # a join cut short gives back what it did not send, now

    async def _refused_join(self, learner_id: str, details: str) -> None:
        """A refused join, logged and counted in /status `refusals` and /metrics `diloco_refusals` (join_refusals.py)."""
        reason = self._join_refusals.log(learner_id, details)
        self.metrics.refused_join(reason)
        try:
            await self._ledger(self.core.refused_join, shown(learner_id), reason)
        except ShuttingDown:
            pass

    async def _join(self, request, context):
        self._count_in(request)
        credential = await self._check_credential(context, request.learner_id, request.token)
        await self._check_id(context, request.learner_id)
        try:
            specs = specs_from_proto(request.specs)
            held = check_held(specs, list(request.held))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad model description: {e}")
        if not self.core.initialized and self._initial_file is not None:
            await self._initialise_from_file(request.learner_id, specs, context)
        if not self.core.initialized:
            yield pb.JoinReply(header=self._init_header(request.learner_id))
            return
        live_for = self._live_for(request.learner_id)
        if live_for is not None and not (credential is not None or self._may_take_over(request)):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, (
                f"learner id {request.learner_id!r} is already live in this run (joined {live_for:.0f} s ago); every "
                f"learner needs its own id — or, in a torchrun job, create the Learner with process_group=... so "
                f"only one rank joins. If that learner is gone, wait {self.core.cfg.absent_after_seconds:.0f} s "
                f"for the syncer to notice, or start the syncer with --allow-takeover"))
        if live_for is not None:
            log.warning("learner %s takes over its live id (%s)", request.learner_id,
                        "its own credential" if credential is not None else
                        "its session secret" if request.session else "--allow-takeover")
        try:
            proof = self.credentials.proof(credential) if credential and self.credentials else ""
            session = await self._core(self.core.join, request.learner_id, specs, credential, proof)
            snapshot = await self._core(self.core.snapshot_for_join, request.learner_id, False)  # lent, not copied
        except Refused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        record = self.core.learners[request.learner_id]
        old = self._queues.get(request.learner_id)
        if old is not None:
            old.put_nowait(None)  # ends the previous session's stream
        self._queues[request.learner_id] = self._new_queue()
        # a new Learner's counters start at 0: its heartbeats may grow them only at a plausible rate from here
        self._samples[request.learner_id] = (session, bounds.Sample(0, 0, time.monotonic()))
        kept = held_fragments([(self.core.fragments[i].fragment, version) for i, version, _ in snapshot],
                              self._initial_digests, held)
        if kept:
            log.info("learner %s holds %d of %d fragments already: not sent", request.learner_id, len(kept),
                     len(snapshot))
        total = sum(codec.encoded_size(values.numel(), "fp32") for i, _, values in snapshot if i not in kept)
        header = pb.JoinHeader(session=session, config_json=self.core.cfg.to_json(), fragments=len(snapshot),
                               data_position=record.data_position, total_bytes=total,
                               start_position=record.start_position)
        try:
            yield pb.JoinReply(header=header)
            while snapshot:  # each fragment given back once sent: a join holds at most what rounds replaced meanwhile
                index, version, values = snapshot[0]
                if index in kept:  # the joiner keeps its own values, equal to these by their digests
                    yield pb.JoinReply(blob=pb.Blob(fragment=index, version=version, codec="fp32",
                                                    numel=values.numel(), held=True))
                else:
                    encoded = await asyncio.to_thread(codec.view_fp32, values)  # its checksum, off the loop; no copy
                    for blob in blobs(index, version, encoded):
                        yield pb.JoinReply(blob=blob)
                    del encoded
                snapshot.pop(0)
                self.core.fragments[index].give_back(values)
                del values
        finally:  # a join cut short gives back what it did not send
            for index, _, values in snapshot:
                self.core.fragments[index].give_back(values)
        self.wake.set()

    async def _admit_push(self, header, context) -> None:
        """A push's header, before any of its data is buffered: the learner's session, counters in bounds, the
        fragment and the payload's size."""
        await self._authenticate(context, header.learner_id, header.session)
        try:
            bounds.check_push_header(header)
        except bounds.OutOfBounds as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "out of bounds", str(e))
        try:
            bounds.check_fragment(header.fragment, len(self.core.fragments))
            if not self.core.owns(header.fragment):
                await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "wrong shard",
                                   f"fragment {header.fragment} is served by {self.core.owner(header.fragment)}; "
                                   f"give the learner every shard's address (--syncer A,B,...)")
            limit = self.core.payload_limit(header.fragment, header.codec)
        except ValueError as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad fragment or codec", f"bad push header: {e}")
        if header.total_bytes > limit:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "oversized",
                               f"push of {header.total_bytes} bytes for fragment {header.fragment} exceeds "
                               f"its {limit}-byte size (wrong fragment, codec or model)")
        numel = self.core.fragments[header.fragment].fragment.numel
        if header.compression and header.numel != numel:  # it sizes the decompression: never larger than the fragment
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad shape",
                               f"compressed push of {header.numel} values for fragment {header.fragment}, which has "
                               f"{numel} (wrong fragment or model)")

    @guarded
    async def Push(self, request_iterator, context):
        chunks = self._chunks(request_iterator, context)
        held: list[str] = []
        granted: list[int] = []
        try:
            return await self._push(chunks, context, held, granted)
        finally:
            for learner_id in held:
                self._push_streams[learner_id] -= 1
                if not self._push_streams[learner_id]:
                    del self._push_streams[learner_id]
            for size in granted:
                await self.push_budget.release(size)
            await chunks.aclose()  # a read still pending ends with the stream

    async def _hold_push_stream(self, context, learner_id: str, held: list[str]) -> None:
        """Count an authenticated push stream against its learner's MAX_STREAMS."""
        if self._push_streams.get(learner_id, 0) >= MAX_STREAMS:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams", (
                f"learner {shown(learner_id)} has {MAX_STREAMS} pushes open already; a learner pushes one at a time"))
        self._push_streams[learner_id] = self._push_streams.get(learner_id, 0) + 1
        held.append(learner_id)

    async def _push(self, chunks, context, held: list[str], granted: list[int]):
        started = time.monotonic()
        header, parts, received = None, [], 0
        async for chunk in chunks:
            if chunk is IDLE:  # the learner retries with the same sequence number
                await self._idle(context, "push", self.stall_timeout)
            self._count_in(chunk, header.codec if header is not None else None)
            if chunk.HasField("header"):
                if header is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a push carries one header, first")
                await self._admit_push(chunk.header, context)
                await self._hold_push_stream(context, chunk.header.learner_id, held)
                header = chunk.header
                granted.append(await self._push_bytes().acquire(header.total_bytes))  # before its data is read
            elif header is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push data before its header")
            else:
                data = chunk.data  # a copy each time it is read
                received += len(data)
                if received > header.total_bytes:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push payload longer than its header says")
                parts.append(data)
        chunk = data = None  # a message keeps its own copy of the data: not held while the push waits for the core
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "push without a header")
        def push():  # on the core worker: joining the parts copies the whole payload
            data = b"".join(parts)
            parts.clear()
            data = unpack(data, header.compression, header.codec, header.numel)  # CorruptPayload: the caller refuses
            payload = codec.Encoded(header.codec, header.numel, data, header.checksum)
            return self.core.push(header.learner_id, header.session, header.seq, header.fragment, header.base_version,
                                  header.steps, header.tokens, payload, header.data_position, time.monotonic() - started,
                                  final=header.final)

        try:
            result = await self._core(push)
        except Refused as e:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "session", str(e))
        except codec.CorruptPayload as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "corrupt payload",
                               f"push of fragment {header.fragment}: {e}")
        if not result.accepted:
            self.metrics.refused(result.reason)
            log.warning("refused push of fragment %d from %s: %s", header.fragment, header.learner_id, result.reason)
        elif not result.duplicate:
            self.metrics.pushes.inc()
        if result.resync:  # refused, or merged before: the learner gets the current values
            try:
                pub = await self._core(self.core.resync, header.learner_id, header.session, header.fragment, header.seq)
            except Refused:  # re-joined meanwhile: the new session gets the values on join
                pub = None
            if pub is not None:  # full values: they replace anything queued for this fragment (UpdateQueue)
                self._queue(header.learner_id).put_nowait((pub, "" if result.accepted else result.reason))
        self.wake.set()
        return pb.PushReply(accepted=result.accepted, reason=result.reason, duplicate=result.duplicate,
                            resync=result.resync, stop=self.core.should_stop())

    async def _check_progress(self, request, context) -> dict:
        """The heartbeat's counters in bounds (and grown at a plausible rate since this session's last heartbeat);
        its floats finite and in range, or left out (a diverged learner's NaN loss is not news the core can use)."""
        sample = self._samples.get(request.learner_id)
        previous = sample[1] if sample is not None and sample[0] == request.session else None
        try:
            for name in ("data_position", "pushes", "applied"):
                bounds.check_counter(f"heartbeat {name}", getattr(request, name))
            bounds.check_progress(request.step, request.tokens_trained, previous, time.monotonic())
        except bounds.OutOfBounds as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "out of bounds", str(e))
        floats, dropped = bounds.finite_fields({
            name: getattr(request, name) if request.HasField(name) else None
            for name in ("loss", "step_seconds", "speed", "tokens_per_second")})
        if dropped and (request.learner_id, request.session) not in self._warned:
            self._warned.add((request.learner_id, request.session))
            log.warning("learner %s reports %s: not finite or out of range, ignored", shown(request.learner_id),
                        ", ".join(dropped))
        return dict(step=request.step, tokens_trained=request.tokens_trained, data_position=request.data_position,
                    pushes=request.pushes, applied=request.applied, **floats)

    @guarded
    async def Heartbeat(self, request, context):
        self._count_in(request)
        await self._authenticate(context, request.learner_id, request.session)
        record = self.core.learners.get(request.learner_id)
        credential = (record.credential if record is not None else "") or request.learner_id
        if not self.heartbeats.allow(credential):  # after authenticating: nobody else can spend a credential's share
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many heartbeats", (
                f"learner {shown(request.learner_id)} sends heartbeats faster than its credential's share, "
                f"{self.heartbeats.rate():g} a second over all its ids; the syncer answers at most that many"))
        progress = await self._check_progress(request, context)
        self._report_received(request)
        started = time.monotonic()
        try:  # beside the core worker: a merge in progress does not delay it
            stop, lead, tokens, progress_share = await self._ledger(
                self.core.heartbeat_reply, request.learner_id, request.session, **progress)
        except Refused as e:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "session", str(e))
        self.metrics.heartbeat_seconds.observe(time.monotonic() - started)
        self._samples[request.learner_id] = (request.session, bounds.Sample(request.step, request.tokens_trained,
                                                                            time.monotonic()))
        self.wake.set()
        return pb.HeartbeatReply(stop=stop, tokens_trained=min(tokens, 2**64 - 1),
                                 budget_progress=progress_share, phase_lead=lead)

    @guarded
    async def Leave(self, request, context):
        self._count_in(request)
        try:
            await self._ledger(self.core.leave, request.learner_id, request.session)
        except Refused:
            return pb.LeaveReply()  # leaving twice, or after a re-join elsewhere, is harmless
        self.wake.set()
        return pb.LeaveReply()

    # ---- rounds -------------------------------------------------------------------------------------------
    async def run_rounds(self, stop: asyncio.Event) -> None:
        """Close rounds when the policy says so: after each request, and at the times it asks to be woken. Also
        watches the event loop's lag meanwhile."""
        lag = asyncio.create_task(self.watch_loop_lag())
        expired_at = absences_at = time.monotonic()
        try:
            while not stop.is_set():
                # no name for them: one kept across the awaits below held a round's full values after delivery
                self.deliver(await self._core(self.core.poll))
                if time.monotonic() - absences_at > ABSENCE_CHECK_SECONDS:
                    absences_at = time.monotonic()
                    await self._ledger(self.core.note_absences)
                if time.monotonic() - expired_at > EXPIRY_SECONDS:
                    expired_at = time.monotonic()
                    self._forget(await self._core(self.core.expire))
                wake_at = await self._core(self.core.next_wakeup)
                timeout = None if wake_at is None else max(0.0, wake_at - self.core.clock())
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=min(timeout, 1.0) if timeout is not None else 1.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            lag.cancel()

    def _forget(self, learner_ids: list[str]) -> None:
        """Drops what the service kept for learners the core forgot."""
        for learner_id in learner_ids:
            queue = self._queues.pop(learner_id, None)
            if queue is not None:
                queue.put_nowait(None)  # ends a stream that may linger
            self._samples.pop(learner_id, None)
            log.info("forgot learner %s (departed long ago)", learner_id)
        if learner_ids:
            gone = set(learner_ids)
            self._warned = {key for key in self._warned if key[0] not in gone}

    async def drain(self) -> None:
        """At shutdown: merge whatever is pending and send it out."""
        self.deliver(await self._core(self.core.poll, True))
        for queue in self._queues.values():
            queue.put_nowait(None)
