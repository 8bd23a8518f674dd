"""The synthetic learners of benchmarks/syncer/load.py: their plans (pace, churn, death), their protocol-level
gRPC clients (join, push, update stream, heartbeats), the client processes they run in, and the heartbeat probe.
No training: each push is a pre-encoded int4 outer gradient of the right size."""

from __future__ import annotations

import asyncio
import json
import os
import contextlib
import random
import time
import traceback
import urllib.request
from collections import Counter
from dataclasses import dataclass

import grpc
import torch

from diloco.algorithm import codec
from diloco.algorithm.digest import values_digest
from diloco.algorithm.fragments import plan_fragments
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import GRPC_OPTIONS, push_chunks, specs_to_proto

TENSORS = 24
"""Equal tensors of the synthetic model: one per fragment at P = 24."""
TOKENS_PER_STEP = 1024
EVENTS_WITHIN = (0.1, 0.5)
"""Share of the window within which leaves and kills happen: early enough that rejoins and absences show in it."""


def fetch(syncer: dict, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{syncer['http']}{path}", timeout=5) as r:
        return r.read()


def status(syncer: dict) -> dict:
    return json.loads(fetch(syncer, "/status"))


JOINS_AT_ONCE = 4
"""Synthetic learners joining at the same time, over all client processes (one semaphore they share): each join
holds a copy of the model on the syncer while it is sent (benchmarks/LOG.md, "Syncer throughput and durable
rounds"), so the benchmark staggers them as a deployment would, and --processes does not change how."""


def share(fraction: float, n: int) -> int:
    """How many of n learners a share is, rounded half up."""
    return min(n, int(fraction * n + 0.5))


@dataclass
class Plan:
    """One synthetic learner's part in the run: its pace (steps per second, lower when slow), and when it leaves or
    is killed (seconds into the window; None: never)."""
    name: str
    pace: float
    slow: bool = False
    leave_at: float | None = None
    kill_at: float | None = None


def make_plans(args) -> list[Plan]:
    rng = random.Random(args.seed)
    names = [f"s{i}" for i in range(args.learners)]
    slow = set(rng.sample(names, share(args.slow_share, len(names))))
    order = rng.sample(names, len(names))
    churned = set(order[:share(args.churn_share, len(names))])
    killed = set(order[len(churned):len(churned) + share(args.kill_share, len(names))])
    plans = []
    for name in names:
        plan = Plan(name, args.steps_per_second * (args.slow_factor if name in slow else 1.0), name in slow)
        when = round(rng.uniform(*EVENTS_WITHIN) * args.seconds, 3)
        if name in churned:
            plan.leave_at = when
        elif name in killed:
            plan.kill_at = when
        plans.append(plan)
    return plans


class Shared:
    """What the parent and its client processes share: the join gate, the phase events (joins open, pushes open,
    the window, the end), the window's start
    (time.monotonic: one clock for every process on Linux) and the queue of messages to the parent."""

    def __init__(self, ctx):
        self.gate = ctx.Semaphore(JOINS_AT_ONCE)
        self.joins, self.pushing, self.go, self.stop = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
        self.window_start = ctx.Value("d", 0.0)
        self.out = ctx.Queue()


@contextlib.asynccontextmanager
async def joining(gate):
    """One of the JOINS_AT_ONCE places, polled: a blocking acquire would stall the event loop."""
    while not gate.acquire(block=False):
        await asyncio.sleep(0.05)
    try:
        yield
    finally:
        gate.release()


class Window:
    """The measured window's start in a client process, once the parent opened it."""

    def __init__(self):
        self.opened = asyncio.Event()
        self.start = 0.0

    def open(self, start: float) -> None:
        if not self.opened.is_set():
            self.start = start
            self.opened.set()

    async def reach(self, offset: float) -> None:
        await self.opened.wait()
        await asyncio.sleep(max(0.0, self.start + offset - time.monotonic()))


def encoded_payloads(specs) -> dict[int, codec.Encoded]:
    torch.manual_seed(0)
    return {f.index: codec.encode(torch.randn(f.numel) * 1e-4, "int4") for f in plan_fragments(specs, TENSORS)}


def variant(payload: codec.Encoded, n: int) -> codec.Encoded:
    """The n-th variant of a fragment's payload: one byte of its int4 values changed (two values by a level or
    two), so that no two pushes carry the same bytes, which the syncer refuses as replays."""
    data = bytearray(payload.data)
    at = len(data) - 1 - n % (len(data) // 2)  # in the values, behind the scales
    data[at] = (data[at] + 1 + n // (len(data) // 2)) % 256
    return codec.Encoded(payload.codec, payload.numel, bytes(data), codec.checksum(data))


def initial_digests(specs) -> list[bytes]:
    """What learners built from the run's initial model (zeros) send with their joins: the syncer sends them none
    of the fragments still at those values."""
    return [values_digest(torch.zeros(s.numel)) for s in specs]


class Client:
    """What the learners of one client process share, and what they measure."""

    def __init__(self, syncers: list[dict], specs, shared: Shared, heartbeat_seconds: float, rejoin_seconds: float,
                 same_start: bool, index: int):
        self.syncers, self.specs, self.shared = syncers, specs, shared
        self.index = index
        self.heartbeat_seconds, self.rejoin_seconds = heartbeat_seconds, rejoin_seconds
        self.payloads = encoded_payloads(specs)
        self.held = initial_digests(specs) if same_start else []
        self.pushed = 0  # over the process's learners: each push's variant
        self.versions: dict[int, int] = {}
        self.window = Window()
        self.counts: Counter = Counter(accepted=0, refused=0, downlink_bytes=0, join_bytes=0)
        self.heartbeats: list[tuple[float, float]] = []
        """(sent at, seconds to its reply) of every heartbeat answered."""
        self.events: list[tuple[float, str, str]] = []
        """(at, learner, "left" | "rejoined" | "killed")."""

    def event(self, learner: str, kind: str) -> None:
        self.events.append((time.monotonic(), learner, kind))

    def figures(self, learners: list[SyntheticLearner]) -> dict:
        return {"counts": dict(self.counts), "heartbeats": self.heartbeats, "events": self.events,
                "pushes": [push for learner in learners for push in learner.pushes.values()]}


class Session:
    """One session of a synthetic learner with every shard: its channels, the secrets Join gave, and the tasks
    that push, heartbeat and read its update streams."""

    def __init__(self, learner: SyntheticLearner):
        self.learner = learner
        self.channels = [grpc.aio.insecure_channel(s["address"], options=GRPC_OPTIONS)
                         for s in learner.client.syncers]
        self.stubs = [pb_grpc.SyncerStub(c) for c in self.channels]
        self.secrets: list[str] = []
        self.tasks: list[asyncio.Task] = []

    async def join(self) -> None:
        learner = self.learner
        request = pb.JoinRequest(learner_id=learner.plan.name, specs=specs_to_proto(learner.client.specs),
                                 held=learner.client.held)
        async with joining(learner.client.shared.gate):
            for stub in self.stubs:  # join every shard; the model it sends is read and dropped
                secret = None
                async for reply in stub.Join(request):
                    if reply.HasField("header"):
                        secret = reply.header.session
                    else:
                        learner.client.counts["join_bytes"] += len(reply.blob.data)
                self.secrets.append(secret)
        self.tasks = [asyncio.create_task(learner.push_loop(self))]
        for stub, secret in zip(self.stubs, self.secrets):
            self.tasks += [asyncio.create_task(learner.heartbeat_loop(stub, secret)),
                           asyncio.create_task(learner.drain(stub, secret))]

    async def end(self, leave: bool) -> None:
        """Stop its tasks; with `leave`, say so to every shard (Leave) before closing the channels."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for stub, secret in zip(self.stubs, self.secrets) if leave else ():
            try:
                await stub.Leave(pb.LeaveRequest(learner_id=self.learner.plan.name, session=secret), timeout=30)
            except grpc.aio.AioRpcError as e:
                self.learner.client.counts[f"leave error {e.code().name}"] += 1
        await self.close()

    async def kill(self) -> None:
        """As a process dying: the channels close first, cutting every call in flight; no Leave."""
        await self.close()
        await self.end(leave=False)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


class SyntheticLearner:
    """A protocol-level learner: joins, pushes a pre-encoded int4 fragment every step of its pace, heartbeats, reads
    its update streams, and leaves and comes back or is killed as its Plan says."""

    def __init__(self, plan: Plan, client: Client):
        self.plan, self.client = plan, client
        self.step = 0
        self.seq = 0  # never reused across sessions: answers are matched to pushes by it
        self.pushes: dict[int, list] = {}
        self.received: dict[str, int] = {}
        """Payload bytes read from each session's update stream, which heartbeats report as a learner's do."""
        """seq → [sent at, accepted (None: no reply), first chunk of its answer at (None: none yet)]."""

    async def run(self) -> None:
        session = await self.open_session()
        self.client.shared.out.put(("joined", self.plan.name))
        try:
            if self.plan.leave_at is not None:
                await self.client.window.reach(self.plan.leave_at)
                await session.end(leave=True)
                self.client.event(self.plan.name, "left")
                await asyncio.sleep(self.client.rejoin_seconds)
                session = await self.open_session()
                self.client.event(self.plan.name, "rejoined")
            if self.plan.kill_at is not None:
                await self.client.window.reach(self.plan.kill_at)
                await session.kill()
                self.client.event(self.plan.name, "killed")
                return
            await asyncio.Event().wait()  # until the client process stops
        finally:
            await session.end(leave=False)

    async def open_session(self) -> Session:
        """A new session on every shard, joining again until it is admitted (each failure counted)."""
        while True:
            session = Session(self)
            try:
                await session.join()
                return session
            except grpc.aio.AioRpcError as e:
                self.client.counts[f"join error {e.code().name}"] += 1
                await session.end(leave=False)
            except asyncio.CancelledError:
                await session.end(leave=False)
                raise
            await asyncio.sleep(1.0)

    async def push_loop(self, session: Session) -> None:
        await wait_for(self.client.shared.pushing)
        started, first = time.monotonic(), self.step
        while True:
            self.step += 1
            fragment = self.step % TENSORS
            shard = fragment % len(session.stubs)
            self.seq += 1
            header = pb.PushHeader(learner_id=self.plan.name, session=session.secrets[shard], seq=self.seq,
                                   fragment=fragment, base_version=self.client.versions.get(fragment, 0),
                                   steps=TENSORS, tokens=TENSORS * TOKENS_PER_STEP)
            self.client.pushed += 1
            payload = variant(self.client.payloads[fragment], self.client.pushed << 8 | self.client.index)  # < 256 processes
            push = self.pushes[self.seq] = [time.monotonic(), None, None]  # before sending: its answer may come first
            try:
                reply = await session.stubs[shard].Push(push_chunks(header, payload))
                push[1] = reply.accepted
                self.client.counts["accepted" if reply.accepted else "refused"] += 1
            except grpc.aio.AioRpcError as e:
                self.client.counts[f"push error {e.code().name}"] += 1
            await asyncio.sleep(max(0.0, started + (self.step - first) / self.plan.pace - time.monotonic()))

    async def heartbeat_loop(self, stub, secret: str) -> None:
        """As the real learner's: one heartbeat every heartbeat_seconds after the last reply, with its timeout."""
        seconds = self.client.heartbeat_seconds
        while True:
            await asyncio.sleep(seconds)
            request = pb.HeartbeatRequest(learner_id=self.plan.name, session=secret, step=self.step,
                                          tokens_trained=self.step * TOKENS_PER_STEP, pushes=self.seq,
                                          step_seconds=1.0 / self.plan.pace, received_bytes=self.received.get(secret, 0))
            sent = time.monotonic()
            try:
                await stub.Heartbeat(request, timeout=max(2.0, 4 * seconds))
            except grpc.aio.AioRpcError as e:
                self.client.counts[f"heartbeat error {e.code().name}"] += 1
                continue
            self.client.heartbeats.append((sent, time.monotonic() - sent))

    async def drain(self, stub, secret: str) -> None:
        """Reads its merged fragments as a learner does (and drops them), timing the first chunk of each answer."""
        try:
            async for blob in stub.Subscribe(pb.SubscribeRequest(learner_id=self.plan.name, session=secret)):
                self.client.counts["downlink_bytes"] += len(blob.data)
                self.received[secret] = self.received.get(secret, 0) + len(blob.data)
                push = self.pushes.get(blob.seq) if blob.offset == 0 else None
                if push is not None and push[2] is None:
                    push[2] = time.monotonic()
        except grpc.aio.AioRpcError:
            pass


async def version_watch(syncers: list[dict], versions: dict) -> None:
    while True:
        for s in syncers:
            try:
                st = await asyncio.to_thread(status, s)
            except OSError:  # a busy syncer: the versions last seen stay
                continue
            for p in st["owned_fragments"]:
                versions[p] = st["versions"][p]
        await asyncio.sleep(0.5)


async def wait_for(event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.05)


async def client(index: int, plans: list[Plan], syncers: list[dict], specs, shared: Shared, heartbeat_seconds: float,
                 rejoin_seconds: float, same_start: bool) -> dict:
    c = Client(syncers, specs, shared, heartbeat_seconds, rejoin_seconds, same_start, index)
    shared.out.put(("ready",))
    await wait_for(shared.joins)
    learners = [SyntheticLearner(plan, c) for plan in plans]
    tasks = [asyncio.create_task(learner.run()) for learner in learners]
    watch = asyncio.create_task(version_watch(syncers, c.versions))
    while not shared.stop.is_set():
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
        if failed is not None:
            raise failed.exception()
        if shared.go.is_set():
            c.window.open(shared.window_start.value)
        await asyncio.sleep(0.1)
    for task in [*tasks, watch]:
        task.cancel()
    await asyncio.gather(*tasks, watch, return_exceptions=True)
    return c.figures(learners)


def client_process(index: int, plans: list[Plan], syncers: list[dict], specs, shared: Shared,
                   heartbeat_seconds: float, rejoin_seconds: float, same_start: bool, nice: int = 0) -> None:
    """A client process: its learners on one asyncio loop; their figures go to the parent once told to stop. `nice`:
    its CPU priority lowered by that much, so that the syncer and the probe run first."""
    if nice:
        os.nice(nice)
    try:
        figures = asyncio.run(client(index, plans, syncers, specs, shared, heartbeat_seconds, rejoin_seconds,
                                     same_start))
    except BaseException:
        shared.out.put(("error", f"client process {index}: {traceback.format_exc()}"))
        raise
    shared.out.put(("figures", figures))


def heartbeat_probe(address: str, specs, ready, go, stop, out) -> None:
    """In a process of its own, so that no client's event loop delays it: join, then from `go` to `stop` heartbeat
    every 50 ms and put the reply times (seconds) on `out`."""
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    stub = pb_grpc.SyncerStub(channel)
    request = pb.JoinRequest(learner_id="probe", specs=specs_to_proto(specs), held=initial_digests(specs))
    session = next(r.header.session for r in stub.Join(request) if r.HasField("header"))  # what moved: dropped
    ready.set()
    go.wait()
    latencies = []
    while not stop.is_set():
        started = time.monotonic()
        stub.Heartbeat(pb.HeartbeatRequest(learner_id="probe", session=session), timeout=30)
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    channel.close()
    out.put(("probe", latencies))
