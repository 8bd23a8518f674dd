"""An update stream lets go of each answer once it is sent: full values kept by an idle stream until its next answer
were a fragment's fp32 copy per learner (the syncer's memory grew by a share of the model per learner), and the
last chunk it sent a chunk per learner."""

import gc
import inspect
import threading
import tracemalloc
import weakref

import grpc
import torch

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode
from diloco.algorithm import codec
from diloco.syncer.serving.serialized_updates import SerializedUpdates
from diloco.wire import diloco_pb2 as pb
from diloco.wire import messages
from diloco.wire.messages import Serialized
from liveness import wait_for
from rpc import push_header, raw_join, stub
from syncers import start_syncer, wide


def test_an_idle_update_stream_holds_no_full_values_it_sent(monkeypatch):
    sent, original = [], SerializedUpdates.blobs

    def recording(self, fragment, version, payload, full=True, result_checksum=0, refused="", *rest):
        if full and refused:  # the answer to a refused push
            sent.append(weakref.ref(payload))
        return original(self, fragment, version, payload, full, result_checksum, refused, *rest)

    monkeypatch.setattr(SerializedUpdates, "blobs", recording)
    syncer = start_syncer()
    try:
        session = raw_join(syncer.address, "m")
        stream = stub(syncer.address).Subscribe(pb.SubscribeRequest(learner_id="m", session=session), timeout=60)
        received = []

        def read():
            try:
                received.extend(stream)
            except grpc.RpcError:  # cancelled at the end
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # non-finite values are refused, and the learner is sent the fragment's full values to start over from
        header, payload = push_header("m", session, payload=codec.encode(torch.full((20,), float("nan")), "fp32"))
        reply = stub(syncer.address).Push(iter([pb.PushChunk(header=header), pb.PushChunk(data=bytes(payload.data))]),
                                          timeout=10)
        assert not reply.accepted and reply.resync
        wait_for(lambda: any(b.full and b.seq == 1 for b in received), timeout=30)
        assert len(sent) == 1

        def released() -> bool:
            gc.collect()
            return sent[0]() is None

        wait_for(released, timeout=10)  # while the stream stays open and waits for its next answer
        assert reader.is_alive()
        stream.cancel()
    finally:
        syncer.stop()


def test_an_idle_update_stream_keeps_no_bytes_of_the_chunks_it_sent(monkeypatch):
    # gRPC's server keeps a stream's last message until the next one: a chunk per learner, held between answers
    source, first = inspect.getsourcelines(Serialized.take)
    chunk_line = first + next(i for i, line in enumerate(source) if "self.data + self.shared" in line)
    sent, original = [], SerializedUpdates.blobs

    def counting(self, *args, **kwargs):
        for message in original(self, *args, **kwargs):
            sent.append(len(message.data) + len(message.shared))
            yield message

    def chunks_held() -> int:
        """Bytes allocated where an update chunk is serialized for one stream, still held."""
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, messages.__file__,
                                                                                 lineno=chunk_line)])
        return sum(stat.size for stat in snapshot.statistics("lineno"))

    monkeypatch.setattr(SerializedUpdates, "blobs", counting)
    tracemalloc.start()
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.05),
                          ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        model = wide(seed=1)
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        for _ in range(8):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)
            learner.step(16, loss=1.0)
        wait_for(lambda: sum(sent) > 256 << 10, timeout=30)  # answers went out, the stream stays open
        wait_for(lambda: chunks_held() < 1024, timeout=10)  # the messages themselves, none of their bytes
        assert syncer.service.update_streams("a") == 1
        learner.close()
    finally:
        syncer.stop()
        tracemalloc.stop()
