"""Joining: exactly one learner uploads the initial model (and the upload passes on when its owner stalls), a join
broken midway starts again cleanly, and a learner id that is live already is refused while a crashed one re-joins
at once."""

import logging
import threading
import time

import grpc
import pytest
import torch
from torch import nn

from diloco.chaos import LinkFaults
from diloco.config import for_mode
from diloco.algorithm.fragments import tensor_specs
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import specs_to_proto

from liveness import wait_for
from rpc import join_replies
from syncers import model_bytes, params, proxy_to, same, syncer_running, wide

pytestmark = pytest.mark.timeout(120)


def messages(caplog, text) -> list[str]:
    return [r.getMessage() for r in list(caplog.records) if text in r.getMessage()]


def test_learners_joining_together_upload_the_initial_model_once(caplog):
    caplog.set_level(logging.INFO, logger="diloco")
    models = [wide(seed=1), wide(seed=2)]
    before = [params(m) for m in models]
    size = model_bytes(models[0])
    learners, errors = {}, []
    start = threading.Barrier(2)
    # capped at 4 MB/s: an upload takes about a second, so the second joiner arrives while the first uploads
    with syncer_running() as syncer, proxy_to(syncer.address, bandwidth_bps=4e6) as p0, \
            proxy_to(syncer.address, bandwidth_bps=4e6) as p1:
        def join(i, proxy):
            try:
                start.wait()
                learners[i] = Learner(models[i], GrpcTransport(proxy.address), f"l{i}")
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=join, args=(i, p)) for i, p in enumerate((p0, p1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(learners) == 2
        uploads = sorted([p0.bytes_up, p1.bytes_up])
        assert uploads[1] >= size  # one learner sent the whole model...
        assert uploads[0] < size / 10  # ...the other only its requests
        owner = 0 if p0.bytes_up > p1.bytes_up else 1
        waiter = 1 - owner
        assert messages(caplog, f"waiting for learner l{owner} to upload the initial model")
        for m in models:  # both hold the uploader's initial parameters
            assert same(params(m), before[owner])
        assert not same(before[waiter], before[owner])
        for learner in learners.values():
            learner.close()


def test_the_upload_passes_to_the_next_joiner_when_its_owner_stalls(caplog):
    caplog.set_level(logging.INFO, logger="diloco")
    slow, fast = wide(seed=1), wide(seed=2)
    fast_initial = params(fast)
    result = {}
    with syncer_running(stall_timeout=1.0) as syncer, proxy_to(syncer.address, bandwidth_bps=50e3) as proxy:
        def join_slowly():  # 40 s per 2 MiB chunk: far more than the syncer's 1 s stall timeout
            try:
                result["slow"] = Learner(slow, GrpcTransport(proxy.address, stall_timeout=60), "slow")
            except Exception as e:
                result["error"] = e

        thread = threading.Thread(target=join_slowly)
        thread.start()
        wait_for(lambda: messages(caplog, "asking learner slow for the initial model"), timeout=30)
        started = time.monotonic()
        quick = Learner(fast, GrpcTransport(syncer.address), "fast")  # waits, then takes the upload over
        assert time.monotonic() - started < 20
        assert messages(caplog, "waiting for learner slow to upload the initial model")
        assert messages(caplog, "learner slow sent no initial parameters")
        assert same(params(fast), fast_initial)
        proxy.set_faults(LinkFaults())  # the slow link recovers: its upload is not needed any more
        thread.join(60)
        assert "error" not in result, result.get("error")
        assert same(params(slow), fast_initial)  # it joined with the model the other learner uploaded
        result["slow"].close()
        quick.close()


def raw_init(address, chunks):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.SyncerStub(channel).Init(iter(chunks), timeout=10)


def test_init_checks_the_token_first_and_takes_data_only_from_the_lease_owner():
    cfg = for_mode("decoupled", 2, fragments=2, sync_every=4)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, token="s3cret"))
    try:
        specs = specs_to_proto(tensor_specs(wide(seed=0)))
        blob = pb.Blob(fragment=0, total_bytes=8, data=b"x" * 8)

        def request(learner_id, token="s3cret"):
            return pb.JoinRequest(learner_id=learner_id, specs=specs, token=token)

        def refused(chunks):
            with pytest.raises(grpc.RpcError) as e:
                raw_init(syncer.address, chunks)
            return e.value.code(), e.value.details()

        assert refused([pb.InitChunk(request=request("x", token="guess")), pb.InitChunk(blob=blob)]) == \
            (grpc.StatusCode.UNAUTHENTICATED, "wrong or missing run token: pass the syncer's --token")
        code, details = refused([pb.InitChunk(blob=blob)])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "must start with the learner's JoinRequest" in details
        code, details = refused([pb.InitChunk(request=request("x"))])  # never joined: holds no lease
        assert code == grpc.StatusCode.ABORTED and "'x' may not upload the initial model" in details
        (reply,) = join_replies(syncer.address, request("x"))
        assert reply.header.need_init and reply.header.init_owner == "x"
        (reply,) = join_replies(syncer.address, request("y"))
        assert reply.header.init_wait and not reply.header.need_init and reply.header.init_owner == "x"
        code, details = refused([pb.InitChunk(request=request("y")), pb.InitChunk(blob=blob)])
        assert code == grpc.StatusCode.ABORTED and "learner x uploads it" in details
        (reply,) = join_replies(syncer.address, request("x"))  # the owner joining again keeps its lease
        assert reply.header.need_init and reply.header.init_owner == "x"
        damaged = pb.Blob(fragment=0, total_bytes=8, offset=4, data=b"x" * 4)
        code, details = refused([pb.InitChunk(request=request("x")), pb.InitChunk(blob=damaged)])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "initial parameters damaged" in details
        (reply,) = join_replies(syncer.address, request("y"))  # x's upload failed: the lease passed on
        assert reply.header.need_init and reply.header.init_owner == "y"
        assert not syncer.status["initialized"]
    finally:
        syncer.stop()


def test_a_join_broken_midway_starts_again_cleanly():
    first, second = wide(seed=1, layers=2), wide(seed=2, layers=2)
    with syncer_running() as syncer, proxy_to(syncer.address, bandwidth_bps=2e6) as proxy:
        a = Learner(first, GrpcTransport(syncer.address), "a")
        model = params(first)
        done = {}
        thread = threading.Thread(target=lambda: done.update(b=Learner(second, GrpcTransport(proxy.address), "b")))
        thread.start()
        wait_for(lambda: proxy.bytes_down > model_bytes(first) / 3, timeout=30)  # part of the model is through
        proxy.drop_connections()
        thread.join(60)
        assert "b" in done, "the join did not complete after its connection was dropped"
        assert proxy.proxy.drops >= 1 and proxy.bytes_down > model_bytes(first) * 4 / 3  # it started again from scratch
        assert same(params(second), model)
        a.close()
        done["b"].close()


def crash(learner):
    """What SIGKILL does to a learner, seen from the syncer: its connection ends without a Leave."""
    learner.transport._closing.set()
    learner.transport.channel.close()


def small(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))


def test_a_live_id_is_refused_and_a_crashed_one_rejoins_at_once():
    with syncer_running(heartbeat_seconds=0.1, absent_after_seconds=30.0) as syncer:
        first = Learner(small(), GrpcTransport(syncer.address), "a")
        wait_for(lambda: {x["id"]: x["state"] for x in syncer.status.get("learners", [])}.get("a") == "live")
        wait_for(lambda: syncer.service.update_streams("a") == 1)  # live means its update stream is open too
        started = time.monotonic()
        with pytest.raises(SyncerError) as e:
            Learner(small(), GrpcTransport(syncer.address, connect_timeout=1.0), "a")
        message = str(e.value)
        assert "learner id 'a' is already live in this run" in message and "every learner needs its own id" in message
        assert "process_group=" in message and "diloco syncer" not in message
        assert time.monotonic() - started < 10
        assert first.transport.error is None  # the live learner is untouched

        crash(first)
        started = time.monotonic()
        again = Learner(small(seed=5), GrpcTransport(syncer.address, connect_timeout=10.0), "a")
        assert time.monotonic() - started < 10  # long before the 30 s absence timeout
        again.close()


def test_finish_leaves_no_transport_thread_behind():
    """A daemon thread still inside gRPC at interpreter exit can abort the process, so close() joins them all."""
    with syncer_running(heartbeat_seconds=0.05) as syncer:
        model = small()
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        threads = list(learner.transport._threads)
        assert {t.name for t in threads} == {"learner-sender", "learner-receiver", "learner-heartbeat"}
        for _ in range(8):
            learner.step(16, loss=1.0)
        learner.finish()
        assert not [t.name for t in threads if t.is_alive()]


def test_a_live_id_is_taken_over_only_with_its_session_secret_or_by_operator_choice():
    with syncer_running(heartbeat_seconds=0.1, absent_after_seconds=30.0) as syncer:
        first = Learner(small(), GrpcTransport(syncer.address), "a")
        wait_for(lambda: {x["id"]: x["state"] for x in syncer.status.get("learners", [])}.get("a") == "live")
        wait_for(lambda: syncer.service.update_streams("a") == 1)
        with pytest.raises(SyncerError, match="already live"):  # a wrong secret is no better than none
            Learner(small(), GrpcTransport(syncer.address, connect_timeout=1.0, session="guess"), "a")
        again = Learner(small(), GrpcTransport(syncer.address, session=first.transport.session), "a")
        assert again.transport.session != first.transport.session
        wait_for(lambda: first.transport.error is not None)  # the old session is over: its calls are refused
        again.close()
        first.close()
    with syncer_running(heartbeat_seconds=0.1, absent_after_seconds=30.0, allow_takeover=True) as syncer:
        first = Learner(small(), GrpcTransport(syncer.address), "a")
        wait_for(lambda: {x["id"]: x["state"] for x in syncer.status.get("learners", [])}.get("a") == "live")
        wait_for(lambda: syncer.service.update_streams("a") == 1)
        again = Learner(small(), GrpcTransport(syncer.address, connect_timeout=5.0), "a")
        again.close()
        first.close()


def test_unknown_ids_and_wrong_secrets_are_answered_alike():
    with syncer_running() as syncer:
        learner = Learner(small(), GrpcTransport(syncer.address), "alpha")
        stub = pb_grpc.SyncerStub(learner.transport.channel)
        answers = []
        for lid in ("alpha", "ghost"):
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(pb.HeartbeatRequest(learner_id=lid, session="guess"), timeout=5)
            answers.append((e.value.code(), e.value.details().replace(lid, "ID")))
        assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.UNAUTHENTICATED
        learner.close()
