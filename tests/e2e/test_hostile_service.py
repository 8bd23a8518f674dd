"""A hostile client at the gRPC boundary: every field of every RPC fuzzed, while an honest learner trains.

Whatever arrives, the syncer answers with a status that says what was wrong (never UNKNOWN), keeps its model finite,
and keeps merging the honest learner's pushes. Then one focused test per class of fix, and the bounds themselves.
"""

import asyncio
import math
import random
import time

import grpc
import pytest
import torch
import zstandard

from diloco.algorithm import codec
from diloco.algorithm.fragments import tensor_specs
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.core import Publication
from diloco.syncer.observation.metrics import SyncerMetrics, reason_label
from diloco.syncer.updates import UpdateQueue
from diloco.wire import bounds
from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import specs_to_proto
from liveness import wait_for
from fakes import TinyNet
from rpc import NUMEL, TOKEN, code_of, push_header, raw_join, stub
from syncers import Honest, start_syncer

U64_MAX = 2**64 - 1
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture
def syncer():
    s = start_syncer()
    yield s
    s.stop()


# ---- the fuzz -----------------------------------------------------------------------------------------------
def fuzz_values(rng):
    u64 = [0, 1, 2, 7, 2**31, 2**32 - 1, 2**32, 2**53, 2**53 + 1, 2**63, U64_MAX, rng.randrange(2**64)]
    u32 = [0, 1, 2, 3, 7, 2**31, 2**32 - 1]
    floats = [0.0, -0.0, 1.0, -1.0, 1e-308, 5e-324, 1e308, -1e308, math.nan, math.inf, -math.inf, 1e12, rng.random()]
    strings = ["", "a", "m", "honest", "x" * 20000, "../etc", "\x00", "é" * 100, " ", "%s", rng.randbytes(8).hex()]
    codecs = ["fp32", "bf16", "int8", "int4", "", "zip", "x" * 1000]
    return u64, u32, floats, strings, codecs


def pick(rng, plausible, extremes, p=0.8):
    """Mostly a plausible value (so requests reach the syncer's core), else one of the extremes."""
    return rng.choice(plausible) if rng.random() < p else rng.choice(extremes)


def fuzz_push(rng, address, session, values):
    u64, u32, _, strings, codecs = values
    learner_id = pick(rng, ["m"], ["honest"] + strings)
    fragment = pick(rng, [0, 1], u32)
    numel = NUMEL.get(fragment, 20)
    good = codec.encode(torch.randn(numel) * 1e-3, rng.choice(["fp32", "bf16", "int8", "int4"]))
    header = pb.PushHeader(
        learner_id=learner_id, session=pick(rng, [session], ["", "0" * 16, "y" * 5000], 0.9),
        seq=pick(rng, [rng.randrange(1, 1000)], u64), fragment=fragment,
        base_version=pick(rng, [0, 1, 2, 5], u64), steps=pick(rng, [1, 4, 30], u64),
        tokens=pick(rng, [8, 32, 4000], u64), data_position=pick(rng, [0, 100], u64),
        codec=pick(rng, [good.codec], codecs), numel=pick(rng, [numel], u64),
        total_bytes=pick(rng, [len(good.data)], u64), checksum=pick(rng, [good.checksum], u32))
    good_data = bytes(good.data)  # payloads are built in a bytearray; protobuf fields take bytes
    data = rng.choice([
        [good_data], [good_data], [good_data], [], [b""], [good_data[: len(good_data) // 2]], [good_data, b"extra"],
        [rng.randbytes(len(good_data))], [bytes(codec.encode(torch.full((numel,), math.nan), "fp32").data)],
        [good_data[:3], good_data[3:]],
    ])
    chunks = [pb.PushChunk(header=header)] + [pb.PushChunk(data=d) for d in data]
    shape = rng.random()
    if shape < 0.05:
        chunks = chunks[1:] or [pb.PushChunk(data=b"x")]  # data before any header
    elif shape < 0.1:
        chunks = chunks + [pb.PushChunk(header=header)]  # two headers
    elif shape < 0.13:
        chunks = []  # no header at all
    return lambda: stub(address).Push(iter(chunks), timeout=10)


def fuzz_heartbeat(rng, address, session, values):
    u64, _, floats, strings, _ = values
    fields = dict(learner_id=pick(rng, ["m"], ["honest"] + strings), session=pick(rng, [session], ["", "0" * 16]),
                  step=pick(rng, [5, 50], u64), tokens_trained=pick(rng, [40, 400], u64),
                  data_position=pick(rng, [0, 100], u64), pushes=pick(rng, [1, 3], u64),
                  applied=pick(rng, [0, 2], u64))
    for name in ("loss", "step_seconds", "speed", "tokens_per_second"):
        if rng.random() < 0.7:
            fields[name] = pick(rng, [0.5, 1.0, 2.5], floats, 0.5)
    return lambda: stub(address).Heartbeat(pb.HeartbeatRequest(**fields), timeout=10)


def fuzz_join(rng, address, values):
    _, _, _, strings, _ = values
    specs = specs_to_proto(tensor_specs(TinyNet()))
    if rng.random() < 0.3:
        specs = [pb.TensorSpec(name=rng.choice(strings + ["y" * 30000]), shape=[rng.choice([0, 1, -1, 2**62, 2**63 - 1])],
                               dtype=rng.choice(["float32", "", "x" * 300]), kind=rng.choice(["", "param", "odd"]))]
    request = pb.JoinRequest(learner_id=pick(rng, ["fresh", "m2"], strings + ["honest"], 0.5), specs=specs,
                             token=rng.choice([TOKEN, TOKEN, "", "guess", "z" * 10000]))
    return lambda: list(stub(address).Join(request, timeout=10))


def fuzz_init(rng, address, values):
    u64, u32, _, strings, codecs = values
    request = pb.JoinRequest(learner_id=rng.choice(strings + ["m"]), token=rng.choice([TOKEN, "", "guess"]))
    blob = pb.Blob(fragment=rng.choice(u32), version=rng.choice(u64), codec=rng.choice(codecs),
                   numel=rng.choice(u64), total_bytes=rng.choice(u64 + [8]), offset=rng.choice(u64 + [0]),
                   data=rng.randbytes(rng.choice([0, 8, 100])))
    chunks = rng.choice([[pb.InitChunk(request=request)], [pb.InitChunk(blob=blob)],
                         [pb.InitChunk(request=request), pb.InitChunk(blob=blob)], []])
    return lambda: stub(address).Init(iter(chunks), timeout=10)


def fuzz_subscribe(rng, address, session, values):
    _, _, _, strings, _ = values
    request = pb.SubscribeRequest(learner_id=rng.choice(strings + ["m"]), session=rng.choice([session, "", "0" * 16]))
    return lambda: list(stub(address).Subscribe(request, timeout=0.3))


def fuzz_leave(rng, address, session, values):
    _, _, _, strings, _ = values
    request = pb.LeaveRequest(learner_id=rng.choice(strings + ["m"]), session=rng.choice(["", "0" * 16, "x" * 9000]))
    return lambda: stub(address).Leave(request, timeout=10)


def test_fuzz_every_rpc_while_an_honest_learner_trains(syncer):
    rng = random.Random(1234)
    values = fuzz_values(rng)
    honest = Honest(syncer.address)
    core = syncer.service.core
    deadline = time.monotonic() + 20
    while core.learners["honest"].merged < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    merged_before = core.learners["honest"].merged
    session = raw_join(syncer.address, "m")
    seen: dict = {}
    started, calls = time.monotonic(), 0
    while calls < 400 and time.monotonic() - started < 60:
        kind = rng.choice(["push", "push", "push", "heartbeat", "heartbeat", "join", "init", "subscribe", "leave"])
        call = {"push": lambda: fuzz_push(rng, syncer.address, session, values),
                "heartbeat": lambda: fuzz_heartbeat(rng, syncer.address, session, values),
                "join": lambda: fuzz_join(rng, syncer.address, values),
                "init": lambda: fuzz_init(rng, syncer.address, values),
                "subscribe": lambda: fuzz_subscribe(rng, syncer.address, session, values),
                "leave": lambda: fuzz_leave(rng, syncer.address, session, values)}[kind]()
        code, details = code_of(call)
        seen.setdefault((kind, code.name), details[:200])
        # the per-learner heartbeat rate is the one RESOURCE_EXHAUSTED a request may get, and it says so
        limited = code == grpc.StatusCode.RESOURCE_EXHAUSTED and kind == "heartbeat" and "faster than" in details
        assert code not in NEVER or limited, f"{kind} ended {code.name}: {details[:500]}"
        assert len(details) <= 2000
        calls += 1
        if rng.random() < 0.02:
            session = raw_join(syncer.address, "m")  # mallory may have left or been replaced: start again
    assert calls >= 100, seen
    deadline = time.monotonic() + 20
    while core.learners["honest"].merged < merged_before + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert core.learners["honest"].merged >= merged_before + 3, "the honest learner's pushes stopped being merged"
    assert honest.error is None and honest.learner.transport.error is None
    assert core.learners["honest"].refused == 0
    honest.finish()
    syncer.stop()
    for name, value in core.params().items():
        assert torch.isfinite(value).all(), f"{name} is not finite"
    codes = {c for (_, c) in seen}
    assert "INVALID_ARGUMENT" in codes and "UNAUTHENTICATED" in codes and "OK" in codes


# ---- one focused test per fix ---------------------------------------------------------------------------------
def slow_stream(first, then=(), wait=5.0):
    """`first`, then nothing for `wait` seconds, then `then`."""
    yield first
    time.sleep(wait)
    yield from then


def test_push_is_authenticated_before_any_data_is_buffered(syncer):
    raw_join(syncer.address, "m")
    for learner_id, session in (("nobody", "0" * 16), ("m", "0" * 16), ("m", "")):
        header, payload = push_header(learner_id, session)
        started = time.monotonic()
        code, details = code_of(lambda: stub(syncer.address).Push(
            slow_stream(pb.PushChunk(header=header), [pb.PushChunk(data=bytes(payload.data))]), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED, details
        assert "join" in details and time.monotonic() - started < 4  # answered at the header, data never read


def test_out_of_range_fragment_of_size_zero_is_invalid_argument(syncer):
    session = raw_join(syncer.address, "m")
    header = pb.PushHeader(learner_id="m", session=session, seq=1, fragment=7, steps=1, tokens=8, codec="fp32",
                           numel=0, total_bytes=0)
    code, details = code_of(lambda: stub(syncer.address).Push(iter([pb.PushChunk(header=header)]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fragment 7 is not in 0..1" in details


@pytest.mark.parametrize("field, value, message", [
    ("seq", U64_MAX, "push seq"), ("base_version", U64_MAX, "push base_version"),
    ("data_position", U64_MAX, "push data_position"), ("steps", U64_MAX, "push steps"),
    ("tokens", U64_MAX, "push tokens"), ("steps", 0, "push steps = 0"), ("tokens", 0, "push tokens = 0"),
    ("tokens", 2**40, "tokens per step"),
])
def test_absurd_push_counters_are_refused(syncer, field, value, message):
    session = raw_join(syncer.address, "m")
    header, payload = push_header("m", session, **{field: value})
    code, details = code_of(lambda: stub(syncer.address).Push(
        iter([pb.PushChunk(header=header), pb.PushChunk(data=bytes(payload.data))]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details


def test_compressed_pushes_that_lie_are_refused_naming_what_was_wrong(syncer):
    session = raw_join(syncer.address, "m")
    payload = codec.encode(torch.randn(NUMEL[1]), "int8")

    def push(data, **fields):
        header, _ = push_header("m", session, payload=payload, total_bytes=len(data), **fields)
        return code_of(lambda: stub(syncer.address).Push(
            iter([pb.PushChunk(header=header), pb.PushChunk(data=data)]), timeout=10))

    code, details = push(bytes(payload.data), compression="lz4")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "push compression 'lz4' is unknown" in details
    code, details = push(b"\x28\xb5\x2f\xfd garbage", compression="zstd")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not decompress" in details
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))  # 16 MB of zeros claimed as 20 values
    code, details = push(bomb, compression="zstd")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fragment 1" in details
    code, details = push(zstandard.ZstdCompressor().compress(bytes(payload.data)), compression="zstd", numel=10**9)
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # a size that would make a gigabyte is refused up front
    code, _ = push(zstandard.ZstdCompressor().compress(bytes(payload.data)), compression="zstd")
    assert code == grpc.StatusCode.OK  # and an honest one is taken


def test_heartbeat_bounds_and_later_heartbeats_still_work(syncer):
    session = raw_join(syncer.address, "m")
    s = stub(syncer.address)
    code, details = code_of(lambda: s.Heartbeat(pb.HeartbeatRequest(learner_id="m", session=session,
                                                                    tokens_trained=U64_MAX), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokens_trained" in details
    code, details = code_of(lambda: s.Heartbeat(pb.HeartbeatRequest(learner_id="m", session=session,
                                                                    tokens_trained=2**40), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "faster than" in details  # 2^40 tokens a second after join
    code, details = code_of(lambda: s.Heartbeat(pb.HeartbeatRequest(learner_id="m", session=session, step=U64_MAX),
                                                timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "step" in details
    reply = s.Heartbeat(pb.HeartbeatRequest(learner_id="m", session=session, step=3, tokens_trained=24,
                                            loss=math.nan, step_seconds=math.inf, speed=-math.inf,
                                            tokens_per_second=math.nan), timeout=10)
    record = syncer.service.core.learners["m"]
    assert record.tokens_trained == 24  # accepted; the non-finite fields were left out
    assert reply.tokens_trained == 0  # what the budget counts: no push carried these tokens
    assert record.loss is None or math.isfinite(record.loss)
    assert record.speed is None or math.isfinite(record.speed)
    assert record.tokens_per_second is None or math.isfinite(record.tokens_per_second)
    assert all(math.isfinite(v) for v in [record.step_time.value or 0.0])
    reply = s.Heartbeat(pb.HeartbeatRequest(learner_id="m", session=session, step=4, tokens_trained=32, loss=2.5),
                        timeout=10)
    assert record.tokens_trained == 32 and reply.tokens_trained == 0


def test_status_shows_heartbeat_counts_as_claimed_and_only_what_pushes_back_as_trained(syncer):
    # finding: /status showed a credential holder's claimed 6.4·10^10 tokens as trained
    session = raw_join(syncer.address, "m")
    s = stub(syncer.address)
    s.Heartbeat(pb.HeartbeatRequest(learner_id="m", session=session, step=3, tokens_trained=24), timeout=10)

    def mallory():
        return next((x for x in syncer.status.get("learners", []) if x["id"] == "m"), {})

    wait_for(lambda: mallory().get("tokens_claimed") == 24, timeout=30)
    assert mallory()["tokens_trained"] == 0 and mallory()["tokens"] == 24  # the older name: the claim
    assert syncer.status["tokens_claimed"] >= 24 and syncer.status["tokens_trained"] == 0  # no push carried any


def test_a_20kb_learner_id_is_invalid_not_unreachable(syncer):
    code, details = code_of(lambda: raw_join(syncer.address, "x" * 20000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "invalid learner id" in details and len(details) < 500
    with pytest.raises(SyncerError, match="invalid learner id") as e:
        Learner(TinyNet(), GrpcTransport(syncer.address, token=TOKEN, connect_timeout=2), "x" * 20000)
    assert "cannot reach" not in str(e.value) and len(str(e.value)) < 500


def test_cli_says_a_long_id_is_invalid(capsys, syncer):
    from diloco.cli import main

    code = main(["learner", "--syncer", syncer.address, "--token", TOKEN, "--id", "x" * 20000, "--max-steps", "1",
                 "--connect-timeout", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "invalid learner id" in err and "cannot reach" not in err


def test_a_thousand_refused_pushes_keep_one_resync_queued():
    # the fixture's 1 s stall timeout is for the slow-sender tests: on a loaded machine a gap between this test's two
    # chunks once exceeded it, and the syncer rightly ended that stream
    syncer = start_syncer(stall_timeout=30.0)
    try:
        session = raw_join(syncer.address, "m")
        s = stub(syncer.address)
        for seq in range(1, 1001):
            header, payload = push_header("m", session, fragment=seq % 2, seq=seq)
            header.checksum ^= 1  # damaged: refused, and a full fp32 resync is due
            reply = s.Push(iter([pb.PushChunk(header=header), pb.PushChunk(data=bytes(payload.data))]), timeout=10)
            assert not reply.accepted and reply.resync
        assert syncer.service._queues["m"].qsize() <= 2  # one per fragment, however many refusals
    finally:
        syncer.stop()


def test_update_queue_is_bounded():
    async def main():
        queue = UpdateQueue(limit=5)
        payload = codec.encode(torch.zeros(4), "fp32")
        for seq in range(1000):
            queue.put_nowait((Publication("m", seq % 3, 0, payload, True, 0, seq), "refused"))
        assert queue.qsize() == 3  # full values supersede what was queued for their fragment
        assert [(await queue.get())[0].seq for _ in range(3)] == [997, 998, 999]
        for seq in range(100):  # deltas nobody reads: the oldest are dropped beyond the limit
            queue.put_nowait(Publication("m", 0, seq, payload, False, 0, seq))
        assert queue.qsize() == 5 and queue.dropped == 95
        queue.put_nowait(None)  # the end of a stream is never dropped
        assert [getattr(await queue.get(), "seq", None) for _ in range(6)] == [95, 96, 97, 98, 99, None]

    asyncio.run(main())


def test_idle_push_and_init_streams_are_ended():
    syncer = start_syncer(stall_timeout=0.5)
    try:
        session = raw_join(syncer.address, "m")
        header, payload = push_header("m", session)
        started = time.monotonic()
        code, details = code_of(lambda: stub(syncer.address).Push(
            slow_stream(pb.PushChunk(header=header), [pb.PushChunk(data=bytes(payload.data))], wait=30), timeout=40))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "nothing arrived" in details
        assert time.monotonic() - started < 10
        started = time.monotonic()
        request = pb.JoinRequest(learner_id="m", token=TOKEN)
        code, details = code_of(lambda: stub(syncer.address).Init(slow_stream(pb.InitChunk(request=request), wait=30),
                                                                  timeout=40))
        # the model exists already: the upload is not needed, and is ended at its first idle period
        assert code == grpc.StatusCode.OK and time.monotonic() - started < 10
    finally:
        syncer.stop()


def test_idle_init_without_a_model_is_ended():
    syncer = start_syncer(stall_timeout=0.2, initialise=False)
    try:
        started = time.monotonic()
        request = pb.JoinRequest(learner_id="m", token=TOKEN, specs=specs_to_proto(tensor_specs(TinyNet())))
        list(stub(syncer.address).Join(request, timeout=10))  # takes the upload lease
        code, details = code_of(lambda: stub(syncer.address).Init(slow_stream(pb.InitChunk(request=request), wait=30),
                                                                  timeout=40))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "initial model upload" in details
        assert time.monotonic() - started < 10
    finally:
        syncer.stop()


def test_refusal_labels_stay_bounded():
    assert reason_label("contribution based on version 3 of fragment 1 which is at 9: fetch") == "stale"
    assert reason_label("stale session for learner 'abc': join again") == "stale session for learner"
    metrics = SyncerMetrics()
    for i in range(200):
        metrics.refused(f"weird reason {'x' * (i % 50)}{chr(65 + i % 26)}: {i}")
    assert len(metrics._reasons) <= 33


# ---- the bounds module ------------------------------------------------------------------------------------------
def test_push_header_bounds():
    ok = pb.PushHeader(seq=1, steps=4, tokens=32, base_version=3, data_position=10, numel=20, total_bytes=80)
    bounds.check_push_header(ok)
    for field, value in (("seq", 2**53 + 1), ("steps", 0), ("tokens", 0), ("tokens", 2**53 + 1),
                         ("base_version", U64_MAX), ("numel", U64_MAX), ("total_bytes", 2**60)):
        header = pb.PushHeader()
        header.CopyFrom(ok)
        setattr(header, field, value)
        with pytest.raises(bounds.OutOfBounds, match=field):
            bounds.check_push_header(header)
    header = pb.PushHeader()
    header.CopyFrom(ok)
    header.tokens = 4 * 2**32 + 1
    with pytest.raises(bounds.OutOfBounds, match="tokens per step"):
        bounds.check_push_header(header)


def test_progress_bounds():
    bounds.check_progress(10, 1000, None, 0.0)
    with pytest.raises(bounds.OutOfBounds, match="tokens_trained"):
        bounds.check_progress(10, 2**53 + 1, None, 0.0)
    before = bounds.Sample(step=10, tokens=1000, at=100.0)
    bounds.check_progress(20, 2000, before, 101.0)
    bounds.check_progress(0, 0, before, 101.0)  # a counter may go down (a restarted learner)
    with pytest.raises(bounds.OutOfBounds, match="faster than"):
        bounds.check_progress(20, 1000 + bounds.MAX_TOKENS_PER_SECOND * 62, before, 101.0)
    with pytest.raises(bounds.OutOfBounds, match="heartbeat step"):
        bounds.check_progress(10 + bounds.MAX_STEPS_PER_SECOND * 62, 1000, before, 101.0)


def test_float_fields_and_fragments():
    floats, dropped = bounds.finite_fields({"loss": math.nan, "step_seconds": 0.25, "speed": -1.0,
                                            "tokens_per_second": math.inf})
    assert floats == {"loss": None, "step_seconds": 0.25, "speed": None, "tokens_per_second": None}
    assert len(dropped) == 3
    assert bounds.check_fragment(1, 2) == 1
    with pytest.raises(bounds.OutOfBounds, match="not in 0..1"):
        bounds.check_fragment(2, 2)
    with pytest.raises(bounds.OutOfBounds, match="no model yet"):
        bounds.check_fragment(0, 0)
    assert bounds.shown("x" * 20000).endswith("(20000 characters)") and len(bounds.shown("x" * 20000)) < 100


def test_initial_upload_larger_than_its_specs_is_refused():
    syncer = start_syncer(initialise=False)
    try:
        request = pb.JoinRequest(learner_id="m", token=TOKEN, specs=specs_to_proto(tensor_specs(TinyNet())))
        list(stub(syncer.address).Join(request, timeout=10))  # takes the upload lease
        blob = pb.Blob(fragment=0, codec="fp32", numel=2**40, total_bytes=2**42, data=b"x" * 1024)
        code, details = code_of(lambda: stub(syncer.address).Init(
            iter([pb.InitChunk(request=request), pb.InitChunk(blob=blob)]), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit" in details
    finally:
        syncer.stop()


def test_a_call_that_arrives_while_the_syncer_stops_is_unavailable_not_unknown():
    import asyncio

    from diloco.syncer.serving.rpc_errors import ShuttingDown
    from diloco.syncer.serving.service import SyncerService

    from concurrent.futures import ThreadPoolExecutor

    from diloco.syncer.serving.rpc_errors import guarded

    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    with pytest.raises(ShuttingDown):
        asyncio.run(SyncerService._run(pool, lambda: None))

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details="", trailing_metadata=()):
            self.code = code
            raise Aborted

    class Service:
        @guarded
        async def Heartbeat(self, request, context):
            return await SyncerService._run(pool, lambda: None)

    context = Context()
    with pytest.raises(Aborted):
        asyncio.run(Service().Heartbeat(None, context))
    assert context.code == grpc.StatusCode.UNAVAILABLE


def test_over_grpc_the_absurd_counters_push_leaves_honest_learners_training():
    # the finding's end: a third contributor's push died with UNKNOWN (overflow), which ended that honest learner
    from diloco.wire import diloco_pb2 as pb

    syncer = start_syncer()
    honest = None
    try:
        session = raw_join(syncer.address, "mallory")
        header, payload = push_header("mallory", session, steps=2**53, tokens=1,
                                      payload=codec.encode(torch.full((20,), 0.01), "fp32"))
        reply = stub(syncer.address).Push(iter([pb.PushChunk(header=header), pb.PushChunk(data=bytes(payload.data))]),
                                          timeout=30)
        assert reply.accepted
        honest = Honest(syncer.address)
        core = syncer.service.core
        wait_for(lambda: core.fragments[1].version >= 3 or honest.error is not None, timeout=120)
        assert honest.error is None and core.fragments[1].version >= 3
        assert all(codec.all_finite(fs.outer_values()) for fs in core.fragments)
    finally:
        if honest is not None:
            honest.finish()
        syncer.stop()
