"""An update stream sends a learner that reads slowly no more than its send window beyond what the learner reports
it received (syncer/serving/send_window.py); before, gRPC took a whole full-value answer into the syncer's memory
at once, for every such learner."""

import threading
import time

import grpc
import torch
from torch import nn

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode
from diloco.algorithm import codec
from diloco.algorithm.fragments import tensor_specs
from diloco.syncer.ledger import session_hash
from diloco.syncer.serving.serialized_updates import SerializedUpdates
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import CHUNK_BYTES, specs_to_proto
from liveness import wait_for

MiB = 1 << 20
VALUES = 5_000_000  # a 20 MB fragment of fp32 values: ten chunks


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(VALUES))
        self.b = nn.Parameter(torch.zeros(10))


def push_chunks(header, data: bytes):
    yield pb.PushChunk(header=header)
    for at in range(0, len(data), CHUNK_BYTES):
        yield pb.PushChunk(data=data[at:at + CHUNK_BYTES])


def slow_subscriber(syncer, channel):
    """A first learner uploads the model; then learner "slow" joins over a bare stub and opens its update stream,
    which the test reads, or not, itself. Returns (stub, session, stream)."""
    Learner(Big(), GrpcTransport(syncer.address), "first").close()
    stub = pb_grpc.SyncerStub(channel)
    join = pb.JoinRequest(learner_id="slow", specs=specs_to_proto(tensor_specs(Big())))
    session = [r for r in stub.Join(join)][0].header.session
    return stub, session, stub.Subscribe(pb.SubscribeRequest(learner_id="slow", session=session))


def push_refused(stub, session: str) -> None:
    """A push of non-finite values from "slow", refused: it is sent the fragment's full values, 20 MB."""
    bad = codec.encode(torch.full((VALUES,), float("nan")), "fp32")
    header = pb.PushHeader(learner_id="slow", session=session, seq=1, fragment=0, base_version=0, steps=1,
                           tokens=8, codec="fp32", numel=VALUES, total_bytes=len(bad.data), checksum=bad.checksum)
    assert stub.Push(push_chunks(header, bytes(bad.data))).resync


def test_a_slow_reader_is_sent_a_window_beyond_what_it_reported(monkeypatch):
    written, original = [], SerializedUpdates.blobs

    def counting(self, *args, **kwargs):
        for blob in original(self, *args, **kwargs):
            yield blob
            written.append(blob.payload)  # resumed: gRPC took the chunk

    monkeypatch.setattr(SerializedUpdates, "blobs", counting)
    # a window of one chunk: gRPC's own flow control takes a few chunks of a stream nobody reads before it holds back
    syncer = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None, send_window=CHUNK_BYTES))
    channel = grpc.insecure_channel(syncer.address)
    try:
        stub, session, stream = slow_subscriber(syncer, channel)  # not read for now
        window = lambda: syncer.service._windows.get(("slow", session_hash(session)))  # noqa: E731
        wait_for(lambda: window() is not None, timeout=30)

        def report(received: int) -> None:
            stub.Heartbeat(pb.HeartbeatRequest(learner_id="slow", session=session, received_bytes=received))

        report(0)
        written.clear()  # the join's chunks
        push_refused(stub, session)
        wait_for(lambda: window().waiting, timeout=30)
        assert sum(written) == window().written == CHUNK_BYTES  # of 20 MB: the rest waits for the learner
        report(CHUNK_BYTES)  # one chunk in: one more may go
        wait_for(lambda: window().written == 2 * CHUNK_BYTES, timeout=30)
        received = []

        def read():
            try:
                for blob in stream:
                    received.append(len(blob.data))
            except grpc.RpcError:  # cancelled at the end
                pass

        threading.Thread(target=read, daemon=True).start()
        report(4 * VALUES)  # all of it: the stream finishes the answer
        wait_for(lambda: sum(received) == 4 * VALUES, timeout=60)
        stream.cancel()
    finally:
        channel.close()
        syncer.stop()


def test_a_learner_reports_what_it_received_and_trains_through_a_small_window():
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None, send_window=64 << 10))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(16, 1024), nn.Linear(1024, 1024))  # changes of 1 MB: past the window
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        deadline = time.monotonic() + 120
        while learner.applied < 2:  # answers are applied at steps: train until two came through the window
            assert time.monotonic() < deadline, f"{learner.pushes} pushes, {learner.applied} applied"
            loss = model(torch.arange(16)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            learner.step(16)
        key = ("a", session_hash(learner.transport.session))

        def reported() -> bool:  # its heartbeats say what came in (the next one, on a busy machine)
            window = syncer.service._windows.get(key)
            return window is not None and (window.received or 0) > 64 << 10

        wait_for(reported, timeout=30)
        learner.finish()
    finally:
        syncer.stop()


def test_a_stream_nobody_reads_holds_up_no_other_learner_s_updates(monkeypatch):
    """Update chunks are written in turns (SEND_TURNS); one turn here, and no send window: a learner that never reads
    its stream while it is sent 20 MB of full values must not keep the turn from another learner's answers."""
    monkeypatch.setattr("diloco.syncer.serving.service.SEND_TURNS", 1)
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None, send_window=0))
    channel = grpc.insecure_channel(syncer.address)
    try:
        stub, session, stream = slow_subscriber(syncer, channel)  # never read
        wait_for(lambda: ("slow", session_hash(session)) in syncer.service._windows, timeout=30)
        push_refused(stub, session)
        model = Big()
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        deadline = time.monotonic() + 120
        while learner.applied < 2:
            assert time.monotonic() < deadline, f"{learner.pushes} pushes, {learner.applied} applied"
            loss = (model.w[:100] - 1).pow(2).sum() + model.b.pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            learner.step(16)
        learner.finish()
        stream.cancel()
    finally:
        channel.close()
        syncer.stop()
