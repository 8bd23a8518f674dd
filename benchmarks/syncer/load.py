"""Load on a real syncer process, shaped like a real run: many synthetic learners sending real int4 pushes of a
large model over gRPC, heartbeating, some slow, some leaving and coming back, some dying.

    python -m benchmarks.syncer.load --learners 64 --params 1e8 --seconds 60 [--shards 2] --json runs/load.json

The syncer (or --shards syncer processes) runs as `diloco syncer` with the decoupled defaults (P = 24, H = 24) and
--absent-after-seconds. One client uploads the initial model (--params fp32 values in 24 equal tensors); then
--learners synthetic learners, asyncio clients spread over --processes client processes, join (each downloads the
model's fragments that moved since it started, not kept; JOINS_AT_ONCE at a time over all processes), and once
all are in (--start-together) each runs the push schedule at its pace: at every
step the fragment due is pushed with a pre-encoded int4 outer gradient, on the version the syncer's /status last
showed, and its merged fragments are read from its update stream. Each heartbeats every --heartbeat-seconds, as a
real learner does. The measured window (--seconds) starts once every learner is in. The run's shape, drawn with
random.Random(--seed): --slow-share of the learners push at --slow-factor of the pace; --churn-share leave once
(Leave, channel closed) at a random time in the window's first half (EVENTS_WITHIN) and join again --rejoin-seconds
later with a new session; --kill-share go silent once in the window's first half (no Leave, channel closed at
once) and never come back. `--slow-share 0 --churn-share 0 --kill-share 0` is the steady load of earlier runs.
A probe in a process of its own joins and heartbeats every 50 ms through the window, free of the clients' loops.

Reported, as JSON (--json, or printed) and a summary of one line per figure: rounds and pushes per second; the
learners' and the probe's heartbeat latency (p50/p99/max: the learners' include their own event loop's delay);
push-to-publish latency (a push sent to the first chunk of its answer on the update stream) and the pushes not
answered by the window's end; who was slow, churned, killed, and when; how long the syncer took to see each killed
learner absent, and its learners' states on /status at the window's end; how long rounds stayed open, at least (the
longest seen open on polls of /status) and at most (the bucket of the longest in the syncer's
diloco_round_open_seconds histogram on /metrics); each syncer's RSS and CPU every second (rss_over_time,
cpu_over_time: seconds since the syncers were up), peak RSS over the model's bytes, CPU seconds per second and
event-loop lag.

Everything runs on 127.0.0.1. When the joins or the window run past --max-seconds (counted from the start), the
run stops and reports what it measured with "stopped_early" (collecting the clients' figures may take STOP_GRACE
seconds more); every process it started is ended on the way out, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from diloco import GrpcTransport, Learner, ShardedTransport
from diloco.algorithm.fragments import tensor_specs
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped
from benchmarks.syncer.load_clients import TENSORS, Shared, client_process, fetch, heartbeat_probe, make_plans, status
from benchmarks.syncer.load_report import (memory_at_peak, merged, push_report, quantiles_ms, shape_report, summary,
                                           window_report)


LEARNERS_PER_PROCESS = 32
"""Default --processes: enough client processes that none runs more learners than this on its event loop."""
STOP_GRACE = 30.0
"""Seconds the client processes and the probe get to send their figures once told to stop."""
SAMPLE_SECONDS = 1.0


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


def start_syncers(shards: int, learners: int, absent_after: float, folder: Path, started: list,
                  extra: list[str] = ()) -> list[dict]:
    """Start the syncers, each Popen appended to `started` as soon as it runs, for the caller to end; `extra`: more
    of `diloco syncer`'s flags."""
    out = []
    for i in range(shards):
        grpc_port, http_port = free_port(), free_port()
        state = folder / f"shard-{i}"
        cmd = [sys.executable, "-m", "diloco", "syncer", "--listen", f"127.0.0.1:{grpc_port}", "--http",
               f"127.0.0.1:{http_port}", "--learners", str(learners), "--state", str(state),
               "--absent-after-seconds", str(absent_after), *extra]
        if shards > 1:
            cmd += ["--shard", f"{i}/{shards}"]
        with open(folder / f"syncer-{i}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        started.append(proc)
        deadline = time.monotonic() + 60
        while not (state / "ready.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"syncer {i} did not start; see {folder / f'syncer-{i}.log'}")
            time.sleep(0.1)
        out.append({"proc": proc, "address": f"127.0.0.1:{grpc_port}", "http": http_port})
    return out


def proc_figures(pid: int) -> tuple[int, int, float]:
    """(current RSS bytes, peak RSS bytes, CPU seconds) of a process, from /proc."""
    kib = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            kib[key] = int(value.split()[0])
    if "VmRSS" not in kib:  # a zombie: it ended and is not reaped yet
        raise ProcessLookupError(pid)
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return 1024 * kib["VmRSS"], 1024 * kib["VmHWM"], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_open_histogram(syncer: dict) -> dict[str, float]:
    """The syncer's diloco_round_open_seconds histogram from /metrics: cumulative counts by bucket bound ("le"),
    and "count" and "sum"."""
    out = {}
    for line in fetch(syncer, "/metrics").decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith('diloco_round_open_seconds_bucket{le="'):
            out[name.split('"')[1]] = float(value)
        elif name in ("diloco_round_open_seconds_count", "diloco_round_open_seconds_sum"):
            out[name.rsplit("_", 1)[1]] = float(value)
    return out


def ended(children: list) -> str | None:
    """Which of the processes started ended before its time: a syncer at all, a client or the probe with an
    error."""
    for p in children:
        if isinstance(p, subprocess.Popen) and p.poll() is not None:
            return f"syncer {p.pid} exited with code {p.returncode}"
        if isinstance(p, multiprocessing.process.BaseProcess) and p.exitcode not in (None, 0):
            return f"{p.name} exited with code {p.exitcode}"
    return None


class Inbox:
    """Messages from the client processes and the probe: readiness and joins as they happen, then their figures."""

    def __init__(self, out, children: list):
        self.out, self.children = out, children
        self.ready = 0
        self.joined = 0
        self.figures: list[dict] = []
        self.probe: list[float] | None = None

    def wait(self, seconds: float) -> None:
        """File what arrives within `seconds`; raise when a process ended before its time."""
        try:
            kind, *body = self.out.get(timeout=max(0.01, seconds))
        except queue.Empty:
            failure = ended(self.children)
            if failure is not None:
                raise RuntimeError(failure) from None
            return
        if kind == "error":
            raise RuntimeError(body[0])
        if kind == "ready":
            self.ready += 1
        elif kind == "joined":
            self.joined += 1
        elif kind == "figures":
            self.figures.append(body[0])
        elif kind == "probe":
            self.probe = body[0]

    def until(self, done, deadline: float) -> bool:
        """Wait until done() or the deadline; whether done."""
        while not done():
            if time.monotonic() >= deadline:
                return False
            self.wait(min(1.0, deadline - time.monotonic()))
        return True


class OpenRounds:
    """Rounds /status shows open (a fragment with pending contributions, at one version), polled about every
    second: the longest time between the first and the last poll showing one round open, a lower bound of how long
    it stayed open (a round seen by one poll only counts 0)."""

    def __init__(self):
        self.seen: dict[tuple[int, int, int], tuple[float, float]] = {}
        """(shard, fragment, version) → (first, last) poll that showed it open."""

    def observe(self, shard: int, st: dict, now: float) -> None:
        for f in st["owned_fragments"]:
            if st["pending"][f]:
                key = (shard, f, st["versions"][f])
                self.seen[key] = (self.seen.get(key, (now, now))[0], now)

    def report(self, still_open: set[tuple[int, int, int]]) -> dict | None:
        """The longest; `still_open`: the rounds open at the end, as (shard, fragment, version)."""
        if not self.seen:
            return None
        (shard, fragment, version), (first, last) = max(self.seen.items(), key=lambda kv: kv[1][1] - kv[1][0])
        return {"at_least_seconds": last - first, "shard": shard, "fragment": fragment, "version": version,
                "still_open_at_end": (shard, fragment, version) in still_open}


class Monitor(threading.Thread):
    """Every SAMPLE_SECONDS: each syncer's RSS and CPU from /proc, and its /status: rounds seen open (from the
    window's start) and learners turning absent."""

    def __init__(self, syncers: list[dict]):
        super().__init__(daemon=True)
        self.syncers = syncers
        self.t0 = time.monotonic()
        self.rss_over_time: list = []
        self.memory_over_time: list = []
        """[seconds, [each syncer's /status memory by part]] at every sample that read them."""
        self.cpu_over_time: list = []
        self.phases: dict[str, float] = {}
        self.open_rounds: OpenRounds | None = None
        self.absences: list[tuple[float, int, str]] = []
        """(at, shard, learner) each time a learner turned absent on a shard's /status."""
        self._absent: set[tuple[int, str]] = set()
        self._done = threading.Event()

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.monotonic() - self.t0, 3)

    def stop(self) -> None:
        self._done.set()
        self.join(30)

    def run(self) -> None:
        cpu = self._cpu()
        while not self._done.wait(SAMPLE_SECONDS):
            try:
                figures = [proc_figures(s["proc"].pid) for s in self.syncers]
            except OSError:  # a syncer ended: the main thread finds out
                return
            t = round(time.monotonic() - self.t0, 3)
            self.rss_over_time.append([t, [rss for rss, _, _ in figures]])
            self.cpu_over_time.append([t, [round((c - c0) / SAMPLE_SECONDS, 3)
                                           for (_, _, c), c0 in zip(figures, cpu)]])
            cpu = [c for _, _, c in figures]
            parts = [self._observe(shard, s) for shard, s in enumerate(self.syncers)]
            if None not in parts:
                self.memory_over_time.append([t, parts])

    def _cpu(self) -> list[float]:
        return [proc_figures(s["proc"].pid)[2] for s in self.syncers]

    def _observe(self, shard: int, syncer: dict) -> dict | None:
        """Rounds open and learners absent from the syncer's /status; its memory by part (None: no answer)."""
        try:
            st = status(syncer)
        except OSError:  # a busy syncer: the next poll
            return None
        now = time.monotonic()
        if self.open_rounds is not None:
            self.open_rounds.observe(shard, st, now)
        for learner in st["learners"]:
            key = (shard, learner["id"])
            if learner["state"] != "absent":
                self._absent.discard(key)
            elif key not in self._absent:
                self._absent.add(key)
                self.absences.append((now, shard, learner["id"]))
        return st["memory"]


def syncer_figures(syncers: list[dict]) -> dict:
    """What is read of the syncers at the window's start and end."""
    statuses = [status(s) for s in syncers]
    return {"statuses": statuses, "proc": [proc_figures(s["proc"].pid) for s in syncers],
            "open_histograms": [round_open_histogram(s) for s in syncers]}


def open_rounds(statuses: list[dict]) -> set[tuple[int, int, int]]:
    """(shard, fragment, version) of each round open on the syncers' /status."""
    return {(shard, f, st["versions"][f]) for shard, st in enumerate(statuses) for f in st["owned_fragments"]
            if st["pending"][f]}


def collect(shared: Shared, inbox: Inbox, clients: int, probe: bool) -> None:
    """Tell everyone to stop and take their figures (those that come within STOP_GRACE)."""
    shared.stop.set()
    inbox.until(lambda: len(inbox.figures) == clients and (inbox.probe is not None or not probe),
                time.monotonic() + STOP_GRACE)


def load(args, syncers: list[dict], specs, monitor: Monitor, children: list, deadline: float) -> dict:
    """Joins, then the window; what was measured, with "stopped_early" when the deadline cut it short."""
    ctx = multiprocessing.get_context("spawn")
    shared = Shared(ctx)
    plans = make_plans(args)
    endpoints = [{"address": s["address"], "http": s["http"]} for s in syncers]
    clients = [ctx.Process(target=client_process, daemon=True, args=(
        i, plans[i::args.processes], endpoints, specs, shared, args.heartbeat_seconds, args.rejoin_seconds,
        args.same_start, args.clients_nice))
        for i in range(args.processes)]
    children += clients
    for c in clients:
        c.start()
    inbox = Inbox(shared.out, children)
    result = {"pids": {"syncers": [s["proc"].pid for s in syncers], "clients": [c.pid for c in clients]}}
    if not inbox.until(lambda: inbox.ready == len(clients), deadline):
        collect(shared, inbox, len(clients), probe=False)
        return {**result, "stopped_early": "--max-seconds reached while the client processes started"}
    monitor.mark("joins")
    joins_started = time.monotonic()
    if not args.start_together:
        shared.pushing.set()
    shared.joins.set()
    all_joined = inbox.until(lambda: inbox.joined == args.learners, deadline)
    shared.pushing.set()
    result["joined"] = inbox.joined
    if not all_joined:
        collect(shared, inbox, len(clients), probe=False)
        return {**result, "counts": merged(inbox.figures)["counts"],
                "stopped_early": f"--max-seconds reached during joins ({inbox.joined} of {args.learners} in)"}
    result["join_seconds_all"] = time.monotonic() - joins_started
    ready = ctx.Event()
    probe = ctx.Process(target=heartbeat_probe, daemon=True,
                        args=(syncers[0]["address"], specs, ready, shared.go, shared.stop, shared.out))
    children.append(probe)
    probe.start()
    result["pids"]["probe"] = probe.pid
    if not inbox.until(ready.is_set, deadline):
        collect(shared, inbox, len(clients), probe=False)
        return {**result, "stopped_early": "--max-seconds reached while the probe joined"}
    before = syncer_figures(syncers)
    start = time.monotonic()
    monitor.open_rounds = OpenRounds()
    monitor.mark("window")
    shared.window_start.value = start
    shared.go.set()
    inbox.until(lambda: False, min(start + args.seconds, deadline))  # through the window, failing fast on errors
    after = syncer_figures(syncers)
    end = time.monotonic()
    monitor.mark("end")
    monitor.stop()
    if deadline < start + args.seconds:
        result["stopped_early"] = f"--max-seconds reached {end - start:.0f} s into the {args.seconds:g} s window"
    result["round_open_longest_seen"] = monitor.open_rounds.report(open_rounds(after["statuses"]))
    collect(shared, inbox, len(clients), probe=True)
    seen = merged(inbox.figures)
    result.update(window_report(before, after, start, end))
    result.update(push_report(seen["pushes"], start, end))
    result["learner_heartbeat"] = quantiles_ms([s for at, s in seen["heartbeats"] if start <= at <= end])
    result["probe_heartbeat"] = quantiles_ms(inbox.probe or [])
    result.update(shape_report(plans, seen["events"], monitor.absences, after["statuses"], start))
    result["counts"] = {"joined": inbox.joined, **seen["counts"]}
    if len(inbox.figures) < len(clients):
        result["missing_client_figures"] = len(clients) - len(inbox.figures)
    return result


def run(args) -> dict:
    """Syncers up, the model uploaded, then `load`. Every process started is ended before the syncers' folder goes,
    however this ends."""
    deadline = time.monotonic() + args.max_seconds
    model = Model(args.params)
    specs = tensor_specs(model)
    children: list = []
    monitor = None
    with tempfile.TemporaryDirectory() as folder:
        try:
            syncers = start_syncers(args.shards, args.learners, args.absent_after_seconds, Path(folder), children,
                                    shlex.split(args.syncer_args))
            monitor = Monitor(syncers)
            monitor.start()
            addresses = [s["address"] for s in syncers]
            transport = GrpcTransport(addresses[0]) if len(addresses) == 1 else ShardedTransport(addresses)
            uploader = Learner(model, transport, "uploader")  # sets the global model, then leaves
            uploader.finish()
            result = load(args, syncers, specs, monitor, children, deadline)
        finally:
            if monitor is not None:
                monitor.stop()
            end_children(children)
    model_bytes = 4 * sum(s.numel for s in specs)
    result = {"learners": args.learners, "processes": args.processes, "shards": args.shards,
              "steps_per_second": args.steps_per_second, "heartbeat_seconds": args.heartbeat_seconds, **result,
              "model_bytes": model_bytes, "rss_over_time": monitor.rss_over_time,
              "cpu_over_time": monitor.cpu_over_time, "memory_over_time": monitor.memory_over_time,
              "memory_at_peak": memory_at_peak(monitor.rss_over_time, monitor.memory_over_time),
              "phases": monitor.phases}
    if "syncer_peak_rss_bytes" in result:
        result["syncer_peak_rss_over_model"] = [r / model_bytes for r in result["syncer_peak_rss_bytes"]]
    return result


def end_children(children: list) -> None:
    """Terminate every process started (syncer Popens, client processes, the probe), then wait for each, killing
    what does not end."""
    for p in children:
        if p.pid is not None:
            p.terminate()
    for p in children:
        if isinstance(p, subprocess.Popen):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        elif p.pid is not None:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learners", type=int, default=64)
    p.add_argument("--params", type=float, default=1e8)
    p.add_argument("--steps-per-second", type=float, default=1.0, help="each synthetic learner's pace (one push a step)")
    p.add_argument("--seconds", type=float, default=60.0, help="measured window, after every learner joined")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--processes", type=int, help=f"client processes the learners are spread over, each with its own "
                   f"event loop (default: at most {LEARNERS_PER_PROCESS} learners in each)")
    p.add_argument("--same-start", action=argparse.BooleanOptionalAction, default=True,
                   help="learners join holding the initial model, as learners built from one seed do, and are sent "
                        "only the fragments that moved since (on)")
    p.add_argument("--start-together", action=argparse.BooleanOptionalAction, default=True,
                   help="learners start pushing once every one has joined, as learners launched together do (on); "
                        "--no-start-together: each right after its own join, so later joins meet rounds under way")
    p.add_argument("--heartbeat-seconds", type=float, default=0.5,
                   help="each learner's heartbeat interval (the real learner's default)")
    p.add_argument("--slow-share", type=float, default=0.25, help="share of the learners that push at --slow-factor "
                   "of the pace (0.25)")
    p.add_argument("--slow-factor", type=float, default=0.5, help="the slow learners' pace over the others' (0.5)")
    p.add_argument("--churn-share", type=float, default=0.125, help="share of the learners that leave once in the "
                   "window's first half and join again --rejoin-seconds later with a new session (0.125)")
    p.add_argument("--rejoin-seconds", type=float, default=3.0, help="a churned learner's time away (3)")
    p.add_argument("--kill-share", type=float, default=0.0625, help="share of the learners killed once in the "
                   "window's first half: silent, channel closed without Leave, never back (0.0625)")
    p.add_argument("--absent-after-seconds", type=float, default=5.0, help="the syncers' flag: a learner silent this "
                   "long is absent (5, so that a killed one shows absent in the window)")
    p.add_argument("--syncer-args", default="", help="more flags for every `diloco syncer`, as one string (e.g. "
                   "\"--agreement-floor 0\")")
    p.add_argument("--clients-nice", type=int, default=0, help="lower the client processes' CPU priority by this much "
                   "(19: the syncer and the probe run first, as a syncer on a machine of its own would; the learners' "
                   "own latencies then include their wait for the CPU)")
    p.add_argument("--seed", type=int, default=0, help="which learners are slow, churned or killed, and when")
    p.add_argument("--max-seconds", type=float, default=900.0, help="wall time for the whole run: past it, stop and "
                   "report what was measured (900)")
    p.add_argument("--json", type=Path, help="write the results here (else printed before the summary)")
    args = p.parse_args()
    args.processes = args.processes or max(1, math.ceil(args.learners / LEARNERS_PER_PROCESS))
    if not 1 <= args.processes < 256:
        p.error(f"--processes {args.processes}: give 1 to 255")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a plain kill ends the children too, via `run`'s finally
    result = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped(result, args), indent=1))
    else:
        print(json.dumps(result, indent=1))
    print("\n".join(summary(result)))


if __name__ == "__main__":
    main()
