"""Heartbeat latency of the syncer's service while rounds of a large fragment are merged.

Builds a SyncerCore and SyncerService on an event loop of its own (no sockets: the probe measures the syncer, not
gRPC), joins learners, and has them push one fragment of `--numel` fp32 values (default 32M, 128 MB) per round,
while a probe sends a heartbeat every `--every` seconds and times each reply. Reports p50/p99/max heartbeat
latency during the merges, the merges' seconds, the event loop's lag and the core queue's depth.

    .venv/bin/python -m benchmarks.syncer.latency [--numel 32000000] [--rounds 3] [--learners 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from diloco.algorithm import codec
from diloco.config import SyncConfig
from diloco.algorithm.fragments import TensorSpec
from diloco.syncer.core import SyncerCore
from diloco.syncer.observation.metrics import SyncerMetrics
from diloco.syncer.serving.service import SyncerService
from diloco.wire import diloco_pb2 as pb


class Context:
    """Enough of a grpc.aio context for a unary handler that succeeds."""

    async def abort(self, code, details="", trailing_metadata=()):
        raise RuntimeError(f"{code}: {details}")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


async def probe(numel: int, rounds: int = 1, learners: int = 2, every: float = 0.01, seed: int = 0,
                down_codec: str = "int8") -> dict:
    """Push `learners` contributions of one `numel`-value fragment and close the round, `rounds` times, while
    heartbeats are timed. Returns latencies (seconds) of heartbeats and status calls made while core work ran."""
    torch.manual_seed(seed)
    specs = [TensorSpec("w", (numel,), "float32")]
    # a quorum of every learner: the round stays open for all the pushes queued at once, then is closed
    core = SyncerCore(SyncConfig(fragments=1, down_codec=down_codec, merge="rda", quorum=learners))
    core.initialize(specs, [torch.randn(numel)])
    service = SyncerService(core, SyncerMetrics())
    ids = [f"l{i}" for i in range(learners)]
    sessions = {i: core.join(i, specs) for i in ids}
    payloads = [codec.encode(torch.randn(numel) * 1e-3, "fp32") for _ in ids]
    # getattr: the probe also runs against the syncer before it had these (to compare)
    lag = asyncio.create_task(service.watch_loop_lag()) if hasattr(service, "watch_loop_lag") else None
    status = getattr(service, "status", None) or (lambda: service._core(core.status))
    queue_depth = getattr(service, "core_queue_depth", lambda: 0)
    busy = asyncio.Event()
    done = asyncio.Event()
    heartbeats: list[float] = []
    statuses: list[float] = []
    depth = 0
    rounds_done = 0

    async def heartbeat_loop():
        nonlocal depth
        context, n = Context(), 0
        while not done.is_set():
            learner = ids[n % len(ids)]
            n += 1
            request = pb.HeartbeatRequest(learner_id=learner, session=sessions[learner], step=1, tokens_trained=100)
            started, rounds_before = time.monotonic(), rounds_done  # counted when it overlaps the core's work
            during = busy.is_set()
            await service.Heartbeat(request, context)
            took = time.monotonic() - started
            if during or busy.is_set() or rounds_done != rounds_before:
                heartbeats.append(took)
                depth = max(depth, queue_depth())
            if n % 10 == 0:
                started, during = time.monotonic(), busy.is_set()
                await status()
                if during:
                    statuses.append(time.monotonic() - started)
            await asyncio.sleep(every)

    probing = asyncio.create_task(heartbeat_loop())
    merges, round_seconds = [], []
    try:
        for r in range(rounds):
            await asyncio.sleep(0.05)
            busy.set()
            started = time.monotonic()
            # every push queued at once, as concurrent Push RPCs would be, then the round closed
            calls = [service._core(core.push, i, sessions[i], r + 1, 0, r, 10, 1000, payloads[k])
                     for k, i in enumerate(ids)]
            calls.append(service._core(core.poll, True))
            results = await asyncio.gather(*calls)
            assert all(res.accepted for res in results[:-1]), results
            round_seconds.append(time.monotonic() - started)
            merges.append(core.merge_stats["last"] if hasattr(core, "merge_stats") else float("nan"))
            busy.clear()
            rounds_done += 1
    finally:
        done.set()  # the heartbeat in flight is still timed
        try:
            await asyncio.wait_for(probing, 60)
        finally:
            probing.cancel()
        if lag is not None:
            lag.cancel()
        for pool in (service._pool, getattr(service, "_ledger_pool", None)):
            if pool is not None:
                pool.shutdown(wait=True)
    return {"heartbeats": heartbeats, "statuses": statuses, "merge_seconds": merges, "round_seconds": round_seconds,
            "loop_lag_max": getattr(service, "loop_lag", {"max": float("nan")})["max"], "core_queue_max": depth}


def summary(result: dict) -> dict:
    hb = result["heartbeats"]
    return {
        "heartbeats_during_work": len(hb),
        "heartbeat_ms": {"p50": round(1e3 * percentile(hb, 0.5), 2), "p99": round(1e3 * percentile(hb, 0.99), 2),
                         "max": round(1e3 * max(hb, default=float("nan")), 2)},
        "status_ms_max": round(1e3 * max(result["statuses"], default=float("nan")), 2),
        "merge_seconds": [round(s, 3) for s in result["merge_seconds"]],
        "round_seconds (pushes + merge)": [round(s, 3) for s in result["round_seconds"]],
        "merge_seconds_mean": round(statistics.mean(result["merge_seconds"]), 3),
        "loop_lag_max_ms": round(1e3 * result["loop_lag_max"], 2),
        "core_queue_max": result["core_queue_max"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=32_000_000, help="values in the fragment (fp32: 4 bytes each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--every", type=float, default=0.01, help="seconds between heartbeats of the probe")
    ap.add_argument("--down-codec", default="int8")
    args = ap.parse_args()
    result = asyncio.run(probe(args.numel, args.rounds, args.learners, args.every, down_codec=args.down_codec))
    out = {"fragment_mb": round(args.numel * 4 / 1e6, 1), "learners": args.learners, "threads": torch.get_num_threads(),
           **summary(result)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
