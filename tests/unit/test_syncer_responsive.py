"""Heartbeats, leaves and status are answered while the syncer's core worker merges a large fragment
(docs/architecture.md, Threading model)."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from diloco.algorithm import codec
from diloco.config import SyncConfig
from diloco.algorithm.fragments import TensorSpec
from diloco.syncer.observation import memory
from diloco.syncer.core import SyncerCore
from diloco.syncer.observation.metrics import SyncerMetrics
from diloco.syncer.serving.service import SyncerService

from benchmarks.syncer import latency as syncer_latency


def test_heartbeats_are_answered_while_a_large_fragment_is_merged(monkeypatch):
    # 25M values (100 MB) and two learners: pushing and merging them keeps the core worker busy for about a second
    # or more here; before heartbeats left the worker, one sent meanwhile waited for all of it (2.4 s measured).
    # A slow disk (persisting held up half a second) keeps the round long enough on a fast machine too.
    monkeypatch.setattr(SyncerCore, "persist", lambda self, changed: time.sleep(0.5))
    result = asyncio.run(syncer_latency.probe(25_000_000, rounds=1, learners=2, every=0.01))
    busy = result["round_seconds"][0]
    heartbeats = result["heartbeats"]
    assert heartbeats, result
    assert max(heartbeats) < min(1.0, 0.5 * busy), (max(heartbeats), busy, syncer_latency.summary(result))
    assert len(heartbeats) >= 5, result
    assert max(result["statuses"], default=0.0) < min(1.0, 0.5 * busy), syncer_latency.summary(result)
    assert result["merge_seconds"][0] > 0


SPECS = [TensorSpec("emb", (64, 4), "float32", True), TensorSpec("w", (256,), "float32")]


def _core_with_pending_round():
    # a clock that stands still: both pushes arrive as the round opens (with no grace window yet, a push arriving
    # later would find it due and open the next one)
    core = SyncerCore(SyncConfig(fragments=2, down_codec="int8"), clock=lambda: 100.0)
    core.initialize(SPECS, [torch.randn(256), torch.randn(256)])
    sessions = {i: core.join(i, SPECS) for i in ("a", "b")}
    for k, (i, s) in enumerate(sessions.items()):
        assert core.push(i, s, 1, 1, 0, 4, 100, codec.encode(torch.randn(256) * 0.01, "fp32")).accepted
    return core, sessions


def test_the_lock_is_not_held_while_a_round_is_persisted():
    """A round's slow part (here persisting, held up on purpose) runs without the core's lock: heartbeats, leaves,
    phase leads and status go on meanwhile, and the round is published only after it is persisted."""
    core, sessions = _core_with_pending_round()
    entered, release = threading.Event(), threading.Event()
    persisted = []

    def slow_persist(changed):
        entered.set()
        assert release.wait(10)
        persisted.append(list(changed))

    core.persist = slow_persist
    out = []
    worker = threading.Thread(target=lambda: out.extend(core.poll(force=True)))
    worker.start()
    try:
        assert entered.wait(10)
        started = time.monotonic()
        stop, lead, tokens, progress = core.heartbeat_reply("a", sessions["a"], step=3, tokens_trained=50)
        status = core.status()
        core.leave("b", sessions["b"])
        assert time.monotonic() - started < 1.0
        assert not stop and tokens == 50 and progress is None
        assert status["versions"][1] == 1 and status["learners"][0]["step"] == 3
        assert not out  # nothing is published before it is persisted
    finally:
        release.set()
        worker.join(10)
    assert persisted == [[1]]
    assert {p.learner for p in out} == {"a", "b"} and all(p.version == 1 for p in out)
    assert core.merge_stats["count"] == 1 and core.status()["merge_seconds"]["count"] == 1


def test_service_reports_queue_depth_loop_lag_and_merge_seconds():
    core, sessions = _core_with_pending_round()
    metrics = SyncerMetrics()
    service = SyncerService(core, metrics)

    async def main():
        lag = asyncio.create_task(service.watch_loop_lag(0.01))
        gate = threading.Event()
        blocked = asyncio.ensure_future(service._core(gate.wait, 10))
        queued = [asyncio.ensure_future(service._core(core.next_wakeup)) for _ in range(3)]
        await asyncio.sleep(0.05)
        depth = service.core_queue_depth()
        status = await service.status()  # answered while the worker is held up
        gate.set()
        await asyncio.gather(blocked, *queued)
        await service._core(core.poll, True)
        time.sleep(0.1)  # the event loop held up on purpose: the lag shows it
        await asyncio.sleep(0.05)
        lag.cancel()
        return depth, status

    try:
        depth, status = asyncio.run(main())
    finally:
        service.shutdown()
    assert depth == 3 and status["core_queue"] == 3
    assert service.core_queue_depth() == 0
    assert service.loop_lag["max"] >= 0.05
    text = metrics.exposition().decode()
    assert "diloco_merge_seconds_count 1.0" in text
    assert "diloco_core_queue_depth 0.0" in text
    assert "diloco_event_loop_lag_seconds_count" in text
    stats = service.stats()
    assert set(stats) == {"core_queue", "loop_lag_seconds", "loop_lag_max_seconds", "memory", "allocator",
                          "kept_payloads_on_disk"}
    assert stats["allocator"] in ("glibc", "jemalloc", "other")
    assert set(stats["memory"]) == {*memory.PARTS, "rss"} and stats["memory"]["model"] > 0
    assert "diloco_syncer_memory_bytes" not in text or "part=" in text
