"""A real run of GPT-2 124M learners against one syncer process: the syncer's memory and how fast it answers.

    python -m benchmarks.syncer.gpt2_run --learners 4 --steps 30 --json runs/gpt2-run.json

`diloco syncer` runs with the decoupled defaults (P = 24, H = 24, int4 up, int8 down) in its own process; each
learner is a process training transformers' GPT2LMHeadModel(GPT2Config()) (124.4M parameters, 475 MiB in fp32) on
random token ids, batch 1×64, one torch thread, for --steps steps (`Learner.finish()` then pushes every fragment's
remaining progress). A probe process heartbeats every 100 ms from the first join to the end and times each reply.
Reported: the syncer's peak RSS (VmHWM) over the fp32 model, the probe's heartbeat latency (p50, p99, max), the
syncer's own event-loop lag and longest merge, rounds, and each learner's step time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped

BATCH, SEQ_LEN = 1, 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config())


def learner(address: str, name: str, steps: int, seed: int, out) -> None:
    import torch

    from diloco import GrpcTransport, Learner

    torch.set_num_threads(1)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    learner = Learner(model, GrpcTransport(address, stall_timeout=300.0, connect_timeout=600.0), name)
    tokens = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        rows = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN), generator=tokens)
        loss = model(input_ids=rows, labels=rows).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(tokens=BATCH * SEQ_LEN, loss=loss.item())
        times.append(time.perf_counter() - started)
    learner.finish()
    out.put({"learner": name, "step_seconds_median": statistics.median(times), "pushes": learner.pushes,
             "applied": learner.applied})


def probe(address: str, http_port: int, stop, out) -> None:
    """Heartbeats every 100 ms as a learner that trains nothing; joins once the model is there (so that it is never
    the one asked for the initial model)."""
    import grpc

    from diloco.algorithm.fragments import tensor_specs
    from diloco.wire import diloco_pb2 as pb
    from diloco.wire import diloco_pb2_grpc as pb_grpc
    from diloco.wire.messages import GRPC_OPTIONS, specs_to_proto

    specs = tensor_specs(build())
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    stub = pb_grpc.SyncerStub(channel)
    while not stop.is_set():
        try:
            if status(http_port).get("initialized"):
                break
        except OSError:
            pass  # not up yet
        time.sleep(1.0)
    session = None
    for reply in stub.Join(pb.JoinRequest(learner_id="probe", specs=specs_to_proto(specs))):
        if reply.HasField("header"):
            session = reply.header.session  # the rest (the model) is read and dropped
    latencies = []
    while not stop.is_set():
        started = time.monotonic()
        stub.Heartbeat(pb.HeartbeatRequest(learner_id="probe", session=session), timeout=60)
        latencies.append(time.monotonic() - started)
        time.sleep(0.1)
    channel.close()
    out.put(latencies)


def proc_status_bytes(pid: int, field: str) -> int:
    """A memory figure of /proc/PID/status (VmHWM: peak RSS, VmRSS: RSS now) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """The syncer's RSS every 0.2 s and the first time training was under way (tokens trained reported): whether
    its peak comes from the joins and the initial upload or from the rounds."""

    def __init__(self, pid: int, http_port: int):
        self.pid, self.http_port, self.samples, self.training_from = pid, http_port, [], None
        self.parts = []
        """The syncer's own account of its memory by part (/status "memory", refreshed every 0.5 s), per sample."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.samples.append((time.monotonic() - self.started, proc_status_bytes(self.pid, "VmRSS")))
                now = status(self.http_port)
                self.parts.append({**now.get("memory", {}), "full_answer_count": now.get("full_answers", {}).get("count", 0)})
                if self.training_from is None and now.get("tokens_trained", 0) > 0:
                    self.training_from = time.monotonic() - self.started
            except (OSError, ValueError):
                pass

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        at = max(range(len(self.samples)), key=lambda i: self.samples[i][1], default=None)
        peak_at, peak = self.samples[at] if at is not None else (None, 0)
        parts = self.parts[at] if at is not None and at < len(self.parts) else {}
        later = [rss for t, rss in self.samples if self.training_from is not None and t >= self.training_from + 10]
        series = [(round(t, 1), round(rss / 2**20)) for t, rss in self.samples[::5]]  # every second, MiB
        return {"rss_peak_sampled_bytes": peak, "rss_peak_at_seconds": peak_at, "rss_mib_series": series,
                "memory_mib_at_sampled_peak": {k: v if k.endswith("count") else round(v / 2**20) for k, v in parts.items()},
                "memory_mib_series": [(round(t, 1), {k: v if k.endswith("count") else round(v / 2**20) for k, v in p.items()})
                                      for (t, _), p in list(zip(self.samples, self.parts))[::5]],
                "training_from_seconds": self.training_from,
                "rss_peak_from_10s_into_training_bytes": max(later, default=0)}


def status(http_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=10) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--steps", type=int, default=30, help="training steps per learner")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    model_bytes = 4 * sum(x.numel() for x in build().parameters())
    grpc_port, http_port = free_port(), free_port()
    address = f"127.0.0.1:{grpc_port}"
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        syncer = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "--listen", address, "--http",
                                   f"127.0.0.1:{http_port}", "--state", str(Path(folder) / "syncer"),
                                   "--learners", str(args.learners)],
                                  stdout=subprocess.DEVNULL, stderr=open(Path(folder) / "syncer.log", "w"),
                                  preexec_fn=die_with_parent())
        try:
            out, stop = ctx.Queue(), ctx.Event()
            started = time.monotonic()
            sampler = RssSampler(syncer.pid, http_port)
            workers = [ctx.Process(target=learner, args=(address, f"gpt2-{i}", args.steps, i, out))
                       for i in range(args.learners)]
            for w in workers:
                w.start()
            prober = ctx.Process(target=probe, args=(address, http_port, stop, out))
            prober.start()
            results = [out.get(timeout=7200) for _ in workers]
            stop.set()
            latencies = out.get(timeout=120)
            for w in [*workers, prober]:
                w.join(60)
            seconds = time.monotonic() - started
            final = status(http_port)
            peak = proc_status_bytes(syncer.pid, "VmHWM")
            sampled = sampler.stop()
        finally:
            syncer.terminate()
            syncer.wait(120)
    lat = sorted(latencies)
    result = {
        "learners": args.learners, "steps": args.steps, "seconds": seconds, "model_bytes": model_bytes,
        "syncer_peak_rss_bytes": peak, "syncer_peak_rss_over_model": peak / model_bytes, **sampled,
        "syncer_peak_rss_in_training_over_model": sampled["rss_peak_from_10s_into_training_bytes"] / model_bytes,
        "heartbeats": len(lat), "heartbeat_p50_ms": 1e3 * statistics.median(lat),
        "heartbeat_p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))], "heartbeat_max_ms": 1e3 * lat[-1],
        "syncer_loop_lag_max_ms": 1e3 * final.get("loop_lag_max_seconds", 0.0),
        "merge_seconds_max": final.get("merge_seconds", {}).get("max"), "rounds": final.get("rounds"),
        "full_answers": final.get("full_answers"),
        "per_learner": sorted(results, key=lambda r: r["learner"]),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped(result, args), indent=1))


if __name__ == "__main__":
    main()
