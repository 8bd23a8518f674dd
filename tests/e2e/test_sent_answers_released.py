"""An update stream lets go of each answer once it is sent: full values kept by an idle stream until its next answer
were a fragment's fp32 copy per learner (the syncer's memory grew by a share of the model per learner)."""

import gc
import threading
import weakref

import grpc
import torch

from diloco.algorithm import codec
from diloco.syncer.serving.serialized_updates import SerializedUpdates
from diloco.wire import diloco_pb2 as pb
from liveness import wait_for
from rpc import push_header, raw_join, stub
from syncers import start_syncer


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
