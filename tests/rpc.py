"""The wire protocol spoken by hand, as a hostile or broken client would: stubs, joins and push headers built field
by field, and the status a call ends with."""

import grpc
import torch

from diloco.algorithm import codec
from diloco.algorithm.fragments import tensor_specs
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import specs_to_proto
from fakes import TinyNet

TOKEN = "s3cret"
NUMEL = {0: 32, 1: 20}
"""TinyNet's fragments at P = 2: values in each."""


def stub(address):
    return pb_grpc.SyncerStub(grpc.insecure_channel(address))


def raw_join(address, learner_id, token=TOKEN) -> str:
    """Join as `learner_id` with TinyNet's specs: the session."""
    request = pb.JoinRequest(learner_id=learner_id, specs=specs_to_proto(tensor_specs(TinyNet())), token=token)
    replies = list(stub(address).Join(request, timeout=10))
    return replies[0].header.session


def code_of(fn):
    """The status a call ends with (OK when it succeeds)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def push_header(learner_id, session, fragment=1, seq=1, payload=None, **fields):
    """A push's header (`fields` over well-formed ones) and its payload, zeros of the fragment's size by default."""
    payload = payload or codec.encode(torch.zeros(NUMEL.get(fragment, 20)), "fp32")
    header = dict(learner_id=learner_id, session=session, seq=seq, fragment=fragment, base_version=0, steps=1,
                  tokens=8, codec=payload.codec, numel=payload.numel, total_bytes=len(payload.data),
                  checksum=payload.checksum)
    header.update(fields)
    return pb.PushHeader(**header), payload


def join(address, learner_id, token, session=""):
    """Join as `learner_id` with TinyNet's specs: (OK, the session), or the status and details it was refused with."""
    request = pb.JoinRequest(learner_id=learner_id, specs=specs_to_proto(tensor_specs(TinyNet())), token=token,
                             session=session)
    try:
        return grpc.StatusCode.OK, list(stub(address).Join(request, timeout=10))[0].header.session
    except grpc.RpcError as e:
        return e.code(), e.details()


def join_replies(address, request):
    """Every reply to a Join `request`."""
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.SyncerStub(channel).Join(request, timeout=10))
