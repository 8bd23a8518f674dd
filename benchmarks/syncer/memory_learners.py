"""The syncer's memory against the number of learners, with real `Learner`s over gRPC, by part at its peak.

    python -m benchmarks.syncer.memory_learners --learners 2 8 --steps 200 --json runs/syncer-memory-learners.json

For each M: a `diloco syncer` process (decoupled defaults), and M `Learner`s in this process on one model of
--params values in 24 equal tensors (one per fragment), stepped in turn with a small change per step (a shared drift
and noise of each learner's own, so that the syncer refuses no push as a replay), then finished (every learner
flushes what it has left at once, as at the end of a run). A thread reads the syncer's /status every 50 ms; reported
per M: the syncer's peak RSS (VmHWM), before the finish and in all, and its parts (`memory` in /status:
docs/architecture.md, "Syncer memory") at the sample with the largest RSS, in MiB and as multiples of the fp32
model, the syncer's CPU seconds per push from the learners' join to their finish (what --mmap-threshold costs), and
what the learners received after their join, with the answers sent as full values (what --change-buffer costs). The
learners share this process and its cores, so some of them lag: what a lagging learner costs the syncer is what this
measures.

What six more learners add, the figure the syncer's memory goal is written in, is printed last: (peak at the last M −
peak at the first) ÷ the model ÷ (their difference) × 6, once per repeat and their median. One run's peak moves by
a few MiB between runs of one setting (the moments when pushes and answers meet), more than 0.05× of a small model:
`--repeats 3` runs the M values in turn three times."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from diloco import GrpcTransport, Learner
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped
from benchmarks.syncer.load import Model, free_port  # the same model shapes as the load benchmark


def proc_mib(pid: int, field: str) -> float:
    return next(int(line.split()[1]) / 1024 for line in open(f"/proc/{pid}/status") if line.startswith(field))


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(learners: int, params: float, steps: int, syncer_flags: list[str], mmap_threshold: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        grpc_port, http_port = free_port(), free_port()
        state = Path(folder) / "state"
        syncer = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "--listen", f"127.0.0.1:{grpc_port}",
                                   "--http", f"127.0.0.1:{http_port}", "--learners", str(learners), "--state",
                                   str(state), *syncer_flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)}
                                                        if mmap_threshold else {})},
                                  preexec_fn=die_with_parent())
        try:
            deadline = time.monotonic() + 120
            while not (state / "ready.json").exists():
                if syncer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the syncer did not start")
                time.sleep(0.1)
            baseline = proc_mib(syncer.pid, "VmHWM")
            peak: dict = {"rss": 0}
            phase = ["join"]
            done = threading.Event()

            def sample():
                while not done.is_set():
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
                            mem = json.loads(r.read()).get("memory", {})
                        if mem.get("rss", 0) > peak["rss"]:
                            peak.clear()
                            peak.update(mem, phase=phase[0])
                    except OSError:
                        pass
                    time.sleep(0.05)

            threading.Thread(target=sample, daemon=True).start()
            cpu_at_start = cpu_seconds(syncer.pid)
            models = [Model(params) for _ in range(learners)]
            fp32 = 4 * sum(p.numel() for p in models[0].parameters())
            started = time.monotonic()
            running = [Learner(m, GrpcTransport(f"127.0.0.1:{grpc_port}"), f"l{i}") for i, m in enumerate(models)]
            phase[0] = "steps"
            received_at_join = sum(learner.transport.bytes_received for learner in running)
            for _ in range(steps):
                for m, learner in zip(models, running):
                    with torch.no_grad():
                        for p in m.parameters():  # a shared drift and noise of its own: no two pushes alike
                            p.add_(torch.randn_like(p), alpha=1e-5).add_(1e-4)
                    learner.step(1024)
            phase[0] = "finish"
            hwm_before_finish = proc_mib(syncer.pid, "VmHWM")
            for learner in running:
                learner.finish()
            time.sleep(1.0)  # a last sample after the flush
            done.set()
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=30) as r:
                full_answers = json.loads(r.read()).get("full_answers", {})
            received = sum(learner.transport.bytes_received for learner in running) - received_at_join
            hwm = proc_mib(syncer.pid, "VmHWM")
            cpu = cpu_seconds(syncer.pid) - cpu_at_start
            pushes = sum(learner.pushes for learner in running)
        finally:
            syncer.terminate()
            syncer.wait(60)
    mib = 2**20
    parts = {k: round(v / mib, 1) for k, v in peak.items() if k not in ("rss", "phase")}
    return {"learners": learners, "model_mib": round(fp32 / mib, 1), "baseline_rss_mib": round(baseline, 1),
            "peak_rss_mib": round(hwm, 1), "peak_before_finish_mib": round(hwm_before_finish, 1),
            "peak_over_model": round(hwm * mib / fp32, 2),
            "peak_above_baseline_over_model": round((hwm - baseline) * mib / fp32, 2),
            "parts_at_peak_mib": parts, "peak_phase": peak.get("phase"), "seconds": round(time.monotonic() - started),
            "mmap_threshold": mmap_threshold, "syncer_cpu_seconds": round(cpu, 2), "pushes": pushes,
            "syncer_cpu_ms_per_push": round(1e3 * cpu / max(pushes, 1), 2),
            "received_after_join_mib": round(received / mib, 1), "full_answers": full_answers.get("count"),
            "full_answers_mib": round(full_answers.get("bytes", 0) / mib, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learners", type=int, nargs="+", default=[2, 8])
    p.add_argument("--params", type=float, default=1.7e7, help="model values (24 equal tensors)")
    p.add_argument("--steps", type=int, default=200, help="inner steps of every learner before it finishes")
    p.add_argument("--syncer-flags", default="", help="extra `diloco syncer` flags")
    p.add_argument("--mmap-threshold", type=int, help="the syncer's MALLOC_MMAP_THRESHOLD_ in bytes (its default: "
                   "diloco.allocator.MAP_ABOVE)")
    p.add_argument("--repeats", type=int, default=1, help="run the --learners in turn this many times")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if min(args.learners) < 1 or args.repeats < 1:
        p.error("--learners wants one or more numbers of learners ≥ 1, and --repeats a count ≥ 1")
    torch.set_num_threads(1)
    results = []
    for repeat in range(args.repeats):
        for m in args.learners:
            results.append({**measure(m, args.params, args.steps, args.syncer_flags.split(), args.mmap_threshold),
                            "repeat": repeat})
            report(results[-1])
    growth = growth_per_six(results)
    if growth:
        def listed(key):
            return ", ".join(f"{g:+.3f}×" for g in growth[key]) + f" (median {growth[key + '_median']:+.3f}×)"
        print(f"six more learners, {growth['from']} → {growth['to']}: peak {listed('peak')} the model; before the "
              f"finish {listed('before_finish')}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped({"learners": results, "growth_per_six": growth}, args), indent=1))
    return 0


def growth_per_six(results: list[dict]) -> dict | None:
    """Per repeat, what six more learners added to the peak between the fewest and the most learners measured, as a
    multiple of the model; None with one number of learners."""
    fewest, most = min(r["learners"] for r in results), max(r["learners"] for r in results)
    if fewest == most:
        return None
    by_repeat = {}
    for r in results:
        by_repeat.setdefault(r["repeat"], {})[r["learners"]] = r
    pairs = [(runs[fewest], runs[most]) for runs in by_repeat.values() if fewest in runs and most in runs]

    def per_six(key):
        return [round((b[key] - a[key]) / a["model_mib"] / (most - fewest) * 6, 4) for a, b in pairs]

    peak, before = per_six("peak_rss_mib"), per_six("peak_before_finish_mib")
    return {"from": fewest, "to": most, "peak": peak, "peak_median": round(statistics.median(peak), 4),
            "before_finish": before, "before_finish_median": round(statistics.median(before), 4)}


def report(r: dict) -> None:
    print(f"M = {r['learners']:3d}: peak RSS {r['peak_rss_mib']:.0f} MiB = {r['peak_over_model']:.2f}× the model "
          f"({r['model_mib']:.0f} MiB), {r['peak_above_baseline_over_model']:.2f}× above the syncer's idle "
          f"{r['baseline_rss_mib']:.0f} MiB, {r['peak_before_finish_mib']:.0f} MiB before the learners "
          f"finished; parts at the peak ({r['peak_phase']}): {r['parts_at_peak_mib']}; "
          f"syncer CPU {r['syncer_cpu_ms_per_push']:.1f} ms a push ({r['pushes']} pushes); learners received "
          f"{r['received_after_join_mib']:.0f} MiB after their join, {r['full_answers']} answers in full values "
          f"({r['full_answers_mib']:.0f} MiB)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
