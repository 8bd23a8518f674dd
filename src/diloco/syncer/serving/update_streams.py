"""The update streams: each learner's queue of merged fragments and resyncs, and Subscribe, which sends them within
the learner's send window (syncer/serving/send_window.py)."""

from __future__ import annotations

import asyncio

import grpc

from diloco.syncer.downlink import Publication, for_current_session
from diloco.syncer.ledger import session_hash
from diloco.syncer.serving.rpc_errors import guarded
from diloco.syncer.serving.send_window import SendWindow
from diloco.syncer.serving.serialized_updates import SerializedUpdates
from diloco.syncer.updates import UpdateQueue
from diloco.wire.bounds import shown

MAX_STREAMS = 4
"""Update streams, and push streams, one learner may hold open at once (a learner uses one of each; a reconnect
may overlap the old stream briefly): one party cannot multiply what it costs the syncer."""

SEND_TURNS = 4
"""Update chunks whose writes start in one turn of the event loop, over all streams. A round's result goes to every
learner at the same moment: unpaced, all 128 streams of a 124M model's load wrote their chunks in the same turn, and
the loop answered nothing else for up to a second (benchmarks/LOG.md, "128 learners: each update serialized once,
and written in turns"). A turn is given back at the loop's next turn, not when its write ends: the write of a stream
nobody reads may wait for as long as that learner's connection lasts."""


class UpdateStreams:
    """Update queues and Subscribe; mixed into SyncerService, whose state (`_queues`, `_streams`, `_windows`,
    `_sending`, `send_window`, `send_turns`, `serialized_updates`, `core`, `metrics`) and helpers (`_refuse`,
    `_refuse_revoked`, `_count_in`) it uses."""

    def _new_queue(self) -> UpdateQueue:
        # generous: a learner catching up may be sent a chain of changes per fragment at once; only a client that
        # never reads reaches this
        return UpdateQueue(16 * max(len(self.core.fragments), self.core.cfg.fragments) + 64)

    def _serialized(self) -> SerializedUpdates:
        """The shared serialized updates, their budget set from the model once there is one: its largest fragment's
        fp32 bytes, room for the latest four int8 changes or one fragment's full values."""
        if not self.serialized_updates.budget and self.core.initialized:
            self.serialized_updates.budget = 4 * max(fs.fragment.numel for fs in self.core.fragments)
        return self.serialized_updates

    def _queue(self, learner_id: str) -> UpdateQueue:
        """The learner's update queue; created on demand for learners restored from saved state."""
        queue = self._queues.get(learner_id)
        if queue is None:
            queue = self._queues[learner_id] = self._new_queue()
        return queue

    def deliver(self, publications: list[Publication]) -> None:
        for pub in publications:
            record = self.core.learners.get(pub.learner)
            # a learner that left reads no more answers (it left once it had those it needed): queued, they would wait
            # for its record to be forgotten, a fragment of full values or a change each, for every learner that
            # finished while the rounds of its last pushes were open
            if for_current_session(pub, record) and not record.revoked and not record.left:
                self._queue(pub.learner).put_nowait(pub)
        if publications:
            self.metrics.observe_rounds(self.core)

    def update_streams(self, learner_id: str) -> int:
        """Update streams open for `learner_id`, over all its sessions."""
        return sum(n for (lid, _), n in list(self._streams.items()) if lid == learner_id)


    def _report_received(self, request) -> None:
        """A heartbeat's `received_bytes` moves its session's send window."""
        window = self._windows.get((request.learner_id, session_hash(request.session)))
        if window is not None and request.HasField("received_bytes"):
            window.report(request.received_bytes)

    @guarded
    async def Subscribe(self, request, context):
        self._count_in(request)
        record = self.core.learners.get(request.learner_id)
        if record is None or not record.check_session(request.session):
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "unknown learner or wrong session",
                               f"unknown learner or wrong session for learner {shown(request.learner_id)}: it left, "
                               f"re-joined elsewhere or never joined; join again")
        await self._refuse_revoked(context, record)
        if self.update_streams(request.learner_id) >= MAX_STREAMS:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams", (
                f"learner {shown(request.learner_id)} has {MAX_STREAMS} update streams open already; a learner "
                f"needs one"))
        queue = self._queue(request.learner_id)
        key = (request.learner_id, session_hash(request.session))  # a restored record knows only the hash
        self._streams[key] = self._streams.get(key, 0) + 1
        window = self._windows.setdefault(key, SendWindow(self.send_window))
        sending = object()
        try:
            while True:
                item = await queue.get()
                if item is None:  # ended: superseded by a new join, forgotten, the syncer stops, or revoked
                    await self._refuse_revoked(context, self.core.learners.get(request.learner_id))
                    return
                pub, refused = item if isinstance(item, tuple) else (item, "")
                self._sending[sending] = pub.payload
                for blob in self._serialized().blobs(pub.fragment, pub.version, pub.payload, pub.full,
                                                     pub.result_checksum, refused, pub.seq,
                                                     self.core.cfg.wire_compression):
                    await window.room_for(blob.payload)
                    await self.send_turns.acquire()  # given back at the loop's next turn, not when the write ends:
                    asyncio.get_running_loop().call_soon(self.send_turns.release)  # a write may wait for its reader
                    yield blob
                del self._sending[sending], item, pub  # not held while the next one is awaited
        finally:  # also when the learner's connection ends (a crash): the id is free to join again
            self._sending.pop(sending, None)
            window.stream_ended()
            self._streams[key] -= 1
            if not self._streams[key]:
                del self._streams[key]
                self._windows.pop(key, None)
