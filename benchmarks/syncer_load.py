"""Load on a real syncer process: many synthetic learners sending real int4 pushes of a large model over gRPC.

    python benchmarks/syncer_load.py --learners 64 --params 1e8 --seconds 60 [--shards 2] --json runs/load.json

The syncer (or --shards syncer processes) runs as `diloco syncer` with the decoupled defaults (P = 24, H = 24). One
client uploads the initial model (--params fp32 values in 24 equal tensors); then --learners synthetic learners, all
asyncio clients in this process, join (each downloads the model, not kept), and each runs the push schedule at
--steps-per-second: at every step the fragment due is pushed with a pre-encoded int4 outer gradient, on the
version the syncer's /status last showed, and reads its merged fragments from its update stream. A probe in a
process of its own heartbeats every 50 ms and times each reply. Reported: rounds per
second, pushes accepted and refused, p50/p99/max heartbeat latency, the syncers' peak RSS and CPU seconds per
second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import torch

from diloco import GrpcTransport, Learner, ShardedTransport
from diloco.algorithm import codec
from diloco.algorithm.fragments import plan_fragments, tensor_specs
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import GRPC_OPTIONS, push_chunks, specs_to_proto
from provenance import stamped

TENSORS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Model(torch.nn.Module):
    """--params values in TENSORS equal matrices: one per fragment at P = 24."""

    def __init__(self, params: float):
        super().__init__()
        side = int((params / TENSORS) ** 0.5)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(side, side)) for _ in range(TENSORS))


def start_syncers(shards: int, learners: int, folder: Path) -> list[dict]:
    out = []
    for i in range(shards):
        grpc_port, http_port = free_port(), free_port()
        state = folder / f"shard-{i}"
        cmd = [sys.executable, "-m", "diloco", "syncer", "--listen", f"127.0.0.1:{grpc_port}", "--http",
               f"127.0.0.1:{http_port}", "--learners", str(learners), "--state", str(state),
               "--absent-after-seconds", "30"]
        if shards > 1:
            cmd += ["--shard", f"{i}/{shards}"]
        log = open(folder / f"syncer-{i}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (state / "ready.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"syncer {i} did not start; see {folder / f'syncer-{i}.log'}")
            time.sleep(0.1)
        out.append({"proc": proc, "address": f"127.0.0.1:{grpc_port}", "http": http_port})
    return out


def status(syncer: dict) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{syncer['http']}/status", timeout=5) as r:
        return json.loads(r.read())


def proc_figures(pid: int) -> tuple[int, float]:
    """(peak RSS bytes, CPU seconds) of a process, from /proc."""
    rss = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmHWM"))
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


JOINS_AT_ONCE = 4
"""Synthetic learners joining at the same time: each join holds a copy of the model on the syncer while it is sent
(benchmarks/LOG.md, "Syncer throughput and durable rounds"), so the benchmark staggers them as a deployment would."""


async def synthetic_learner(name: str, syncers: list[dict], specs, payloads, versions: dict, rate: float,
                            until: float, counts: dict, gate: asyncio.Semaphore) -> None:
    channels = [grpc.aio.insecure_channel(s["address"], options=GRPC_OPTIONS) for s in syncers]
    stubs = [pb_grpc.SyncerStub(c) for c in channels]
    sessions = []
    async with gate:
        for stub in stubs:  # join every shard; the model it sends is read and dropped
            session = None
            async for reply in stub.Join(pb.JoinRequest(learner_id=name, specs=specs_to_proto(specs))):
                if reply.HasField("header"):
                    session = reply.header.session
            sessions.append(session)
    counts["joined"] += 1

    async def drain(stub, session):  # reads its merged fragments as a learner does (and drops them)
        try:
            async for blob in stub.Subscribe(pb.SubscribeRequest(learner_id=name, session=session)):
                counts["downlink_bytes"] += len(blob.data)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
    readers = [asyncio.create_task(drain(stub, session)) for stub, session in zip(stubs, sessions)]
    step, seq = 0, 0
    started = time.monotonic()
    while time.monotonic() < until:
        step += 1
        fragment = step % TENSORS
        shard = fragment % len(stubs)
        seq += 1
        header = pb.PushHeader(learner_id=name, session=sessions[shard], seq=seq, fragment=fragment,
                               base_version=versions.get(fragment, 0), steps=TENSORS, tokens=TENSORS * 1024)
        try:
            reply = await stubs[shard].Push(push_chunks(header, payloads[fragment]))
            counts["accepted" if reply.accepted else "refused"] += 1
        except grpc.aio.AioRpcError as e:
            counts[f"error {e.code().name}"] = counts.get(f"error {e.code().name}", 0) + 1
        await asyncio.sleep(max(0.0, started + step / rate - time.monotonic()))
    for reader in readers:
        reader.cancel()
    for channel in channels:
        await channel.close()


def heartbeat_probe(address: str, specs, ready, go, seconds: float, out) -> None:
    """In a process of its own, so that the clients' event loop does not delay it: join, then heartbeat every
    50 ms for `seconds` after `go` is set and put the reply times (seconds) on `out`."""
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    stub = pb_grpc.SyncerStub(channel)
    request = pb.JoinRequest(learner_id="probe", specs=specs_to_proto(specs))
    session = next(r.header.session for r in stub.Join(request) if r.HasField("header"))  # rest of the model: dropped
    ready.set()
    go.wait()
    latencies, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.monotonic()
        stub.Heartbeat(pb.HeartbeatRequest(learner_id="probe", session=session), timeout=30)
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    channel.close()
    out.put(latencies)


async def version_watch(syncers: list[dict], versions: dict, until: float) -> None:
    while time.monotonic() < until:
        for s in syncers:
            st = await asyncio.to_thread(status, s)
            for p in st["owned_fragments"]:
                versions[p] = st["versions"][p]
        await asyncio.sleep(0.5)


async def load(syncers, specs, learners: int, rate: float, seconds: float) -> dict:
    torch.manual_seed(0)
    layout = plan_fragments(specs, TENSORS)
    payloads = {f.index: codec.encode(torch.randn(f.numel) * 1e-4, "int4") for f in layout}
    counts = {"joined": 0, "accepted": 0, "refused": 0, "downlink_bytes": 0}
    versions: dict[int, int] = {}
    joined_at = time.monotonic()
    until = joined_at + seconds + 600  # joins first; the measured window starts when every learner is in
    gate = asyncio.Semaphore(JOINS_AT_ONCE)
    tasks = [asyncio.create_task(synthetic_learner(f"s{i}", syncers, specs, payloads, versions, rate, until, counts, gate))
             for i in range(learners)]
    while counts["joined"] < learners:
        await asyncio.sleep(0.2)
    join_seconds = time.monotonic() - joined_at
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=heartbeat_probe, args=(syncers[0]["address"], specs, ready, go, seconds, out), daemon=True)
    probe.start()
    while not ready.is_set():
        await asyncio.sleep(0.2)
    start = time.monotonic()
    figures0 = [proc_figures(s["proc"].pid) for s in syncers]
    rounds0 = sum(status(s)["rounds"] for s in syncers)
    lag0 = [status(s)["loop_lag_max_seconds"] for s in syncers]
    done0 = counts["accepted"] + counts["refused"]
    go.set()
    await version_watch(syncers, versions, start + seconds)
    latencies = await asyncio.to_thread(out.get, True, 120)
    probe.join(10)
    elapsed = time.monotonic() - start
    lag = [status(s)["loop_lag_max_seconds"] for s in syncers]
    rounds = sum(status(s)["rounds"] for s in syncers) - rounds0
    figures = [proc_figures(s["proc"].pid) for s in syncers]
    pushes = counts["accepted"] + counts["refused"] - done0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    lat = sorted(latencies)
    return {
        "learners": learners, "shards": len(syncers), "steps_per_second": rate, "seconds": elapsed,
        "join_seconds_all": join_seconds, "rounds_per_second": rounds / elapsed, "pushes_per_second": pushes / elapsed,
        "counts": counts, "heartbeat_p50_ms": 1e3 * statistics.median(lat),
        "heartbeat_p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))], "heartbeat_max_ms": 1e3 * lat[-1],
        "heartbeats": len(lat), "syncer_peak_rss_bytes": [rss for rss, _ in figures],
        # the largest lag of each syncer's event loop before the window (joins) and over the whole run
        "syncer_loop_lag_max_ms_joins": [1e3 * a for a in lag0], "syncer_loop_lag_max_ms": [1e3 * b for b in lag],
        "syncer_cpu_per_second": [(cpu - cpu0) / elapsed for (_, cpu), (_, cpu0) in zip(figures, figures0)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learners", type=int, default=64)
    p.add_argument("--params", type=float, default=1e8)
    p.add_argument("--steps-per-second", type=float, default=1.0, help="each synthetic learner's pace (one push a step)")
    p.add_argument("--seconds", type=float, default=60.0, help="measured window, after every learner joined")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    model = Model(args.params)
    specs = tensor_specs(model)
    model_bytes = 4 * sum(s.numel for s in specs)
    with tempfile.TemporaryDirectory() as folder:
        syncers = start_syncers(args.shards, args.learners, Path(folder))
        try:
            addresses = [s["address"] for s in syncers]
            transport = GrpcTransport(addresses[0]) if len(addresses) == 1 else ShardedTransport(addresses)
            uploader = Learner(model, transport, "uploader")  # sets the global model, then leaves
            uploader.finish()
            result = asyncio.run(load(syncers, specs, args.learners, args.steps_per_second, args.seconds))
        finally:
            for s in syncers:
                s["proc"].terminate()
                s["proc"].wait(60)
    result["model_bytes"] = model_bytes
    result["syncer_peak_rss_over_model"] = [r / model_bytes for r in result["syncer_peak_rss_bytes"]]
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped(result, args), indent=1))


if __name__ == "__main__":
    main()
