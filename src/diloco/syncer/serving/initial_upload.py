"""The initial model's upload (the Init RPC and its lease), part of `SyncerService`.

The first learner to join a syncer without a model is asked for it (`need_init` in its JoinHeader) and holds a
lease on the upload; others wait. An upload that fails or sends nothing for stall_timeout passes the lease to the
next joiner. What it sends is checked against its own tensor specs before anything is buffered."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from diloco.algorithm import codec
from diloco.algorithm.digest import fragment_digests
from diloco.syncer.at_rest import initial_model
from diloco.syncer.core import Refused
from diloco.syncer.serving.rpc_errors import guarded
from diloco.wire import diloco_pb2 as pb
from diloco.wire.bounds import shown
from diloco.wire.messages import Assembler, specs_from_proto

log = logging.getLogger("diloco.syncer")

NOT_OWNED = torch.zeros(0)
"""The initial values of a fragment another shard owns: not decoded, not kept."""
IDLE = object()
"""Yielded by SyncerService._chunks when a client stream sent nothing for stall_timeout."""
INIT_IDLE_STALLS = 10
"""An uploader's Init stream idle this many stall timeouts is ended (its lease passes on after one, as before). One
that sent nothing, not even its JoinRequest (no token shown), is ended after one."""


class InitialUpload:
    """Init and its lease; mixed into SyncerService, whose state (`_init_owner`, `_init_lease`, `_init_active_at`,
    `_initial_file`, `_initial_digests`, `core`, `stall_timeout`) and helpers (`_chunks`, `_idle`, `_refuse`, `_core`,
    `_check_token`, `_check_id`, counting) it uses."""

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

    @guarded
    async def Init(self, request_iterator, context):
        first, lease, idle = None, 0, 0
        chunks = self._chunks(request_iterator, context)
        try:
            async for chunk in chunks:
                if chunk is IDLE:  # the lease passes on when another learner joins (_take_init_lease)
                    idle += 1
                    if first is None:  # unauthenticated: it holds a stream and nothing more, model or not
                        await self._idle(context, "initial model upload (not even a JoinRequest)", self.stall_timeout)
                    if self.core.initialized:
                        return pb.InitReply()  # another upload won: the rest is not needed
                    if idle >= INIT_IDLE_STALLS:
                        await self._idle(context, "initial model upload", idle * self.stall_timeout)
                    continue
                idle = 0
                self._count_in(chunk)
                if first is None:  # checked before anything is buffered
                    first = await self._admit_init(chunk, context)
                    if self.core.initialized:
                        return pb.InitReply()  # another upload won: nothing to receive
                    budget, received = self._init_budget(first), 0
                    lease, flats, assembler = self._init_lease, {}, Assembler(max_payload_bytes=budget)
                    self._init_active_at = time.monotonic()
                    continue
                if self.core.initialized:
                    return pb.InitReply()  # another upload won meanwhile: the rest is not needed
                await self._check_init_lease(first.learner_id, lease, context)
                self._init_active_at = time.monotonic()  # progress: the lease stays with this upload
                if not chunk.HasField("blob"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Init carries one JoinRequest, first")
                received += len(chunk.blob.data)
                if received > budget:
                    await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "oversized",
                                       f"initial parameters exceed the {budget} bytes its tensor specs describe")
                try:
                    done = assembler.add(chunk.blob)
                    if done is not None:  # a fragment another shard owns is not kept: a shard holds its own part
                        owned = self.core.owns(done.fragment)
                        flats[done.fragment] = codec.decode(done.payload) if owned else NOT_OWNED
                except codec.CorruptPayload as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"initial parameters damaged: {e}")
            if first is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Init must start with the learner's JoinRequest")
            if self.core.initialized:
                return pb.InitReply()
            await self._check_init_lease(first.learner_id, lease, context)
            try:
                ordered = [flats[i] for i in range(len(flats))]
                adopted = await self._core(self._adopt, specs_from_proto(first.specs), ordered)
            except (Refused, KeyError, ValueError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot initialise the global model: {e}")
            if adopted:
                log.info("global model initialised from learner %s (%d fragments)", first.learner_id, len(self.core.fragments))
            return pb.InitReply()
        finally:
            await chunks.aclose()  # a read still pending ends with the stream
            if self.core.initialized:
                self._init_owner = None
            elif first is not None and self._init_lease == lease and self._init_owner == first.learner_id:
                log.warning("learner %s's upload of the initial model failed; the next joiner uploads it", first.learner_id)
                self._init_owner = None  # failed: the lease passes to the next joiner

    async def _initialise_from_file(self, learner_id: str, specs, context) -> None:
        """Adopt --initial-model's values, laid out by the first joiner's specs: nobody uploads. A joiner whose model
        the file does not fit is refused, and the file waits for the next."""
        source = self._initial_file
        try:
            flats = await asyncio.to_thread(initial_model.fragment_values, specs, self.core.cfg.fragments, source,
                                          self.core.cfg.split_tensors, self.core.owns)
            adopted = await self._core(self._adopt, specs, flats)
        except (ValueError, Refused) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, (
                f"the model of learner {shown(learner_id)} does not match the syncer's --initial-model "
                f"{source.path.name}: {e}; load the same model (architecture and names) on the learner, or start "
                f"the syncer without --initial-model"))
        if adopted:
            log.info("global model initialised from %s (%d fragments), laid out by learner %s", source.path,
                     len(self.core.fragments), learner_id)
        self._initial_file = None  # the core holds its values now

    def _adopt(self, specs, flats) -> bool:
        """`core.initialize`, and the digests of what it adopted, taken on the core worker before any join can be
        served: a fragment is skipped for a joiner only while it still holds exactly these values (version 0)."""
        adopted = self.core.initialize(specs, flats, take=True)  # made here for it: no second copy
        if adopted:
            owned = [(fs.fragment, flat) for fs, flat in zip(self.core.fragments, flats)
                     if self.core.owns(fs.fragment.index)]
            self._initial_digests = fragment_digests([f for f, _ in owned], [flat for _, flat in owned])
        return adopted

    def _init_budget(self, request: pb.JoinRequest) -> int:
        """Bytes an initial upload may carry: every tensor its specs name, in fp32, plus slack per fragment."""
        numel = 0
        for spec in specs_from_proto(request.specs):
            size = 1
            for d in spec.shape:
                size *= max(int(d), 0)
            numel += size
        return codec.encoded_size(numel, "fp32") + (self.core.cfg.fragments + 2) * 4096

    async def _admit_init(self, chunk, context) -> pb.JoinRequest:
        """The first Init chunk: the uploader's JoinRequest, with the run token, from the lease owner."""
        if not chunk.HasField("request"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Init must start with the learner's JoinRequest")
        await self._check_credential(context, chunk.request.learner_id, chunk.request.token)
        await self._check_id(context, chunk.request.learner_id)
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
                            f"learner {shown(learner_id)} may not upload the initial model now ({why}); join again")
