"""Update chunks start their writes in turns: when a round's result goes to every learner at once, no turn of the
event loop starts more than SEND_TURNS of them, so heartbeats are answered between."""

from __future__ import annotations

import asyncio

import torch

from diloco.algorithm import codec
from diloco.algorithm.fragments import TensorSpec
from diloco.config import SyncConfig
from diloco.syncer.core import SyncerCore
from diloco.syncer.downlink import Publication
from diloco.syncer.observation.metrics import SyncerMetrics
from diloco.syncer.serving.service import SyncerService
from diloco.syncer.serving.update_streams import SEND_TURNS
from diloco.wire import diloco_pb2 as pb

SPECS = [TensorSpec("a", (256,), "float32"), TensorSpec("b", (256,), "float32")]
STREAMS = 3 * SEND_TURNS


def test_no_turn_of_the_event_loop_starts_more_than_send_turns_writes():
    core = SyncerCore(SyncConfig(fragments=2), clock=lambda: 100.0)
    core.initialize(SPECS, [torch.zeros(256), torch.zeros(256)])
    sessions = {f"l{i}": core.join(f"l{i}", SPECS) for i in range(STREAMS)}
    service = SyncerService(core, SyncerMetrics())
    change = codec.encode(torch.ones(256), "int8")  # one payload for every learner, as a round's result is

    async def main() -> list[int]:
        turn, written = [0], []

        def tick():  # counts the loop's turns
            turn[0] += 1
            loop.call_soon(tick)

        async def read(learner_id: str) -> None:
            stream = service.Subscribe(pb.SubscribeRequest(learner_id=learner_id, session=sessions[learner_id]), None)
            async for _ in stream:
                written.append(turn[0])
                break
            await stream.aclose()

        loop = asyncio.get_running_loop()
        readers = [asyncio.create_task(read(i)) for i in sessions]
        await asyncio.sleep(0.01)  # every stream waits on its queue
        loop.call_soon(tick)
        for learner_id in sessions:
            service._queue(learner_id).put_nowait(Publication(learner_id, 1, 1, change, False, 0))
        await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
        return written

    try:
        written = asyncio.run(main())
    finally:
        service.shutdown()
    per_turn = [written.count(t) for t in set(written)]
    assert len(written) == STREAMS and max(per_turn) <= SEND_TURNS and len(per_turn) >= STREAMS // SEND_TURNS
