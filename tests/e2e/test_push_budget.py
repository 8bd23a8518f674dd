"""The syncer holds at most its push budget of payload bytes at once, however many learners push: a push beyond it
waits for bytes before its data is read, and is then merged like any other (syncer/serving/push_budget.py)."""

import asyncio
import gc
import threading
import types

import pytest
import torch
from torch import nn

from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.syncer.serving.push_budget import PushBudget
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.wire import diloco_pb2 as pb
from liveness import wait_for

pytestmark = pytest.mark.timeout(120)


def test_a_push_beyond_the_budget_waits_for_bytes_and_one_larger_than_it_runs_alone():
    async def scenario():
        budget = PushBudget(100)
        first = await budget.acquire(60)
        second = asyncio.ensure_future(budget.acquire(60))  # 120 > 100: waits
        await asyncio.sleep(0)
        assert not second.done() and budget.waited == 1 and budget.held == 60
        await budget.release(first)
        assert await second == 60 and budget.held == 60
        huge = asyncio.ensure_future(budget.acquire(500))  # larger than the budget: all of it, alone
        await asyncio.sleep(0)
        assert not huge.done()
        await budget.release(60)
        assert await huge == 100 and budget.held == budget.peak == 100
        await budget.release(100)
        assert budget.held == 0

    asyncio.run(scenario())


def test_unbounded_until_the_model_size_is_known():
    async def scenario():
        budget = PushBudget()
        assert await budget.acquire(10**9) == 10**9  # no limit yet: never waits
        await budget.release(10**9)
        budget.set_limit(10)
        assert await budget.acquire(50) == 10

    asyncio.run(scenario())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(4))


def test_many_learners_pushing_while_the_core_is_busy_stay_within_the_budget():
    # every learner moves by the same constant: their payloads repeat byte for byte, which is not a replay here
    cfg = for_mode("decoupled", 4, fragments=4, sync_every=4, refuse_replays=False)
    # the model is 4 × 256 KiB in fp32; a quarter of it holds about eight int4 pushes of one fragment
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, push_buffer_share=0.03))
    learners, release = [], threading.Event()
    try:
        torch.manual_seed(0)
        learners = [Learner(Net(), GrpcTransport(syncer.address), f"l{i}") for i in range(6)]
        service = syncer.service
        core = service.core
        busy = threading.Event()
        real_push = core.push

        def slow_push(*args, **kwargs):  # the worker is busy merging: pushes queue up on the service
            busy.set()
            release.wait(60)
            return real_push(*args, **kwargs)

        core.push = slow_push
        limit = service._push_bytes().limit
        assert limit and limit < 6 * 256 * 256 * 4 // 8
        for step in range(4):  # every learner pushes each fragment once
            for learner in learners:
                with torch.no_grad():
                    for p in learner.model.parameters():
                        p.add_(1e-3)
                learner.step(1024)
        wait_for(lambda: service.push_budget.waited > 0, 60)
        assert service.push_budget.held <= limit and service.memory()["receiving"] <= limit
        release.set()
        for learner in learners:
            learner.finish(timeout=60)  # every push delivered: none failed for waiting
        learners = []
        assert service.push_budget.peak <= limit and service.push_budget.held == 0
        status = core.status()
        assert not status["refusals"] and status["tokens_merged"] == 6 * 4 * 1024
    finally:
        release.set()
        for learner in learners:
            learner.close()
        syncer.stop()


def messages_with_data(frame_locals) -> list[str]:
    return [name for name, value in frame_locals.items()
            if isinstance(value, pb.PushChunk) and value.HasField("data") and value.data]


def test_a_push_waiting_for_the_core_holds_its_payload_once():
    # a message keeps its own copy of its data: a handler that kept its last chunk while the push waits for the
    # core worker (behind other pushes, when the syncer is busy) held every waiting payload twice
    cfg = for_mode("decoupled", 2, fragments=4, sync_every=4)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    learner, seen = None, []
    try:
        core = syncer.service.core
        real_push = core.push

        def inspecting_push(*args, **kwargs):  # on the core worker, while the handler awaits it
            live = gc.get_objects()
            frames = [o.cr_frame for o in live if type(o) is types.CoroutineType and o.cr_frame is not None]
            frames += [o.ag_frame for o in live if type(o) is types.AsyncGeneratorType and o.ag_frame is not None]
            seen.append([f"{f.f_code.co_name}.{name}" for f in frames
                         if f.f_code.co_filename.endswith("service.py") for name in messages_with_data(f.f_locals)])
            return real_push(*args, **kwargs)

        core.push = inspecting_push
        learner = Learner(Net(), GrpcTransport(syncer.address), "a")
        for _ in range(4):
            with torch.no_grad():
                for p in learner.model.parameters():
                    p.add_(1e-3)
            learner.step(1024)
        learner.finish(timeout=60)
        learner = None
        assert len(seen) >= 4 and seen == [[]] * len(seen), seen
    finally:
        if learner is not None:
            learner.close()
        syncer.stop()
