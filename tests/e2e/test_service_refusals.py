"""Untrusted input at the gRPC boundary: refused with a reason, never merged, the syncer keeps serving."""

import grpc
import pytest
import torch

from diloco.algorithm import codec
from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from fakes import TinyNet


@pytest.fixture
def syncer():
    s = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                     ServerOptions(listen="127.0.0.1:0", http=None, token="s3cret"))
    yield s
    s.stop()


def test_wrong_token_is_refused(syncer):
    with pytest.raises(SyncerError, match="wrong or missing run token"):
        Learner(TinyNet(), GrpcTransport(syncer.address, token="guess"), "a")


def test_invalid_learner_id_is_refused(syncer):
    with pytest.raises(SyncerError, match="invalid learner id"):
        Learner(TinyNet(), GrpcTransport(syncer.address, token="s3cret"), "../etc")


def push_raw(address, messages):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.SyncerStub(channel).Push(iter(messages), timeout=10)


def test_oversized_or_headerless_push_is_refused_before_buffering(syncer):
    learner = Learner(TinyNet(), GrpcTransport(syncer.address, token="s3cret"), "a")
    session = learner.transport.session
    header = pb.PushHeader(learner_id="a", session=session, seq=99, fragment=1, base_version=0, steps=1, tokens=1,
                           codec="int4", numel=20, total_bytes=1 << 30, checksum=0)
    with pytest.raises(grpc.RpcError) as e:
        push_raw(syncer.address, [pb.PushChunk(header=header), pb.PushChunk(data=b"x" * 1024)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        push_raw(syncer.address, [pb.PushChunk(data=b"x")])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "before its header" in e.value.details()
    # a damaged payload: refused with a reason, the learner is told to resynchronise, nothing merged
    payload = codec.encode(torch.ones(20), "fp32")  # fragment 1 is lin.weight + lin.bias: 20 values
    header = pb.PushHeader(learner_id="a", session=session, seq=100, fragment=1, base_version=0, steps=1, tokens=10,
                           codec="fp32", numel=20, total_bytes=len(payload.data), checksum=payload.checksum ^ 1)
    reply = push_raw(syncer.address, [pb.PushChunk(header=header), pb.PushChunk(data=bytes(payload.data))])
    assert not reply.accepted and reply.resync and "checksum" in reply.reason
    learner.close()
    assert syncer.stop()["rounds"] == 0  # nothing was merged
