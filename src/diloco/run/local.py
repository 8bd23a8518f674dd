"""Orchestrates `diloco run`: launches processes, shows progress, stops them, and writes the report."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live

from diloco import checks
from diloco.chaos.injector import Injector
from diloco.config import for_mode
from diloco.options import model_config
from diloco.run.cluster import ClusterError, LocalCluster, RunFailed, collect_summaries, with_signal
from diloco.run.pacing import auto_pace, parse_pace, parse_speeds
from diloco.status_view import progress_table
from diloco.run.links import link_text
from diloco.run.live_eval import LiveEval
from diloco.run.report import build_report, print_summary
from diloco.syncer.observation import annotations
from diloco.train.train_config import TrainConfig
from diloco.train.loop import train_config_to_json

log = logging.getLogger("diloco.run")
DEFAULT_DURATION = 120.0


TINY = model_config("tiny")


@dataclass
class Plan:
    mode: str
    learners: int
    speeds: list[float]
    out: Path
    train: TrainConfig
    steps: int | None
    tokens: int | None
    duration: float | None
    ranks_per_learner: int = 1
    """Processes per learner: more than 1 starts each learner as a torchrun job (DDP over gloo)."""
    chaos: str | None = None
    faults: list | None = None
    fault_timeline: list | None = None
    fault_origin_unix: float | None = None
    """Unix time that the fault schedule's second 0 corresponds to (the first trained tokens)."""
    tensorboard: Path | None = None
    """Where learners and the report write TensorBoard event files (one directory per learner, and global/)."""
    syncer_shards: int = 1
    """Syncer processes, each serving the fragments p with p mod N = i (docs/architecture.md, Sharded syncers)."""
    pace: float | None = None
    """Seconds per step at speed 1 that every learner is padded to (None: unpaced); fixes each learner's capacity."""
    link: float | None = None
    """Bits per second each way of every learner's (dp: worker's) own shaped link (run/links.py); None: loopback."""
    link_latency_ms: float = 0.0
    """One-way delay that a proxy adds to each learner's connections to the syncer (not in dp)."""
    snapshots: int = 8
    """Global-model snapshots over the budget, for the eval-loss curve (`--snapshots`; dp: every steps/N steps)."""
    initial_model: Path | None = None
    """The syncer's --initial-model: the built-in model as learners build it, written into the run (None: uploaded)."""
    http: str | None = None
    """HOST:PORT of the (first) syncer's dashboard, /status, /history and /metrics (`--http`); None: a free port."""


def make_plan(args) -> Plan:
    from diloco.options import sync_overrides, train_config

    if args.learners < 1:
        raise ValueError(f"--learners must be at least 1, got {args.learners}")
    speeds = parse_speeds(args.speeds, args.learners)
    for flag in ("steps", "tokens", "duration"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag} must be positive, got {value}")
    duration = args.duration
    if args.steps is None and args.tokens is None and duration is None:
        duration = DEFAULT_DURATION
    if args.mtbf is not None and args.mtbf <= 0:
        raise ValueError(f"--mtbf must be positive, got {args.mtbf}")
    ranks = getattr(args, "ranks_per_learner", 1)
    if ranks < 1:
        raise ValueError(f"--ranks-per-learner must be at least 1, got {ranks}")
    if ranks > 1 and args.mode == "dp":
        raise ValueError("--ranks-per-learner applies to learners of a syncer; --mode dp runs one process per worker")
    pace = parse_pace(getattr(args, "pace", None))  # before anything is written: a bad value leaves no run folder
    shards = getattr(args, "syncer_shards", 1)
    if shards < 1:
        raise ValueError(f"--syncer-shards must be at least 1, got {shards}")
    if shards > 1 and args.mode == "dp":
        raise ValueError("--syncer-shards applies to runs with a syncer; --mode dp has none")
    if getattr(args, "initial_model", "upload") == "file" and args.mode == "dp":
        raise ValueError("--initial-model file applies to runs with a syncer; --mode dp's workers each build the model")
    link, latency = network(args)
    http = dashboard_address(args, shards)
    train = train_config(args)
    checks.corpus(train, args.learners)  # refused here, not by each of the processes it would have started
    if args.mode != "dp":
        sync = for_mode(args.mode, args.learners, **sync_overrides(args))
        if sync.split_tensors and shards > 1:
            raise ValueError("--split-tensors cannot be used with --syncer-shards: a split tensor's pieces would lie "
                             "in several shards' models; use one syncer, or shard without --split-tensors")
        from diloco.algorithm.fragments import plan_fragments, tensor_specs
        from diloco.train.model import build_model

        plan_fragments(tensor_specs(build_model(train.model, train.seed)), sync.fragments, sync.split_tensors)  # a bad P now
    out = args.out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{args.mode}"
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"run directory {out} exists and is not empty; choose another --out")
    if getattr(args, "tensorboard", None):
        checks.writable_dir("--tensorboard", args.tensorboard)
    checks.writable_dir("--out", out)
    (out / "train_config.json").write_text(train_config_to_json(train))
    initial_model = None
    if args.mode != "dp":
        (out / "sync_config.json").write_text(sync.to_json())
        if getattr(args, "initial_model", "upload") == "file":
            initial_model = out / "initial-model.safetensors"
            save_built_in_model(train, initial_model)
    faults = None
    if args.chaos:
        from diloco.chaos.fault_schedule import load

        if not duration:
            raise ValueError("--chaos needs a --duration budget: killed learners restart with fresh step counts")
        faults = load(args.chaos, duration, [f"learner-{i}" for i in range(args.learners)], train.seed, args.mtbf)
        if args.mode == "dp" and any(f.kind in ("partition", "syncer-crash") for f in faults):
            raise ValueError("data-parallel runs have no syncer link: their scenarios may kill, hang or slow workers")
        if shards > 1 and any(f.kind in ("partition", "syncer-crash") for f in faults):
            raise ValueError("scenarios with syncer crashes or partitions take one syncer; drop --syncer-shards")
    if pace == "auto" or (pace is None and args.chaos):  # faults: goodput needs capacities that do not move
        pace = auto_pace(train, args.learners * ranks + 1)  # the learners and the syncer (or dp's rank 0 work)
        log.info("pacing every step at %.3f s (speed 1), measured on this machine", pace)
    pace = None if pace == "off" else pace
    return Plan(args.mode, args.learners, speeds, out, train, args.steps, args.tokens, duration, ranks, args.chaos,
                faults, tensorboard=getattr(args, "tensorboard", None), syncer_shards=shards, pace=pace, link=link,
                link_latency_ms=latency, snapshots=max(1, getattr(args, "snapshots", 8)), initial_model=initial_model,
                http=http)


def dashboard_address(args, shards: int) -> str | None:
    """`--http HOST:PORT` checked before anything starts: on 127.0.0.1 (the run's syncer has no token to guard
    more, and the run reads /status there) and free, for every shard (PORT + i)."""
    text = getattr(args, "http", None)
    if text is None:
        return None
    import socket

    host, port = text.rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost"):
        raise checks.InputError(f"--http {text}: diloco run serves its dashboard on 127.0.0.1 only (its syncer has "
                                f"no token); open it from elsewhere through a tunnel (ssh -L), or run `diloco syncer "
                                f"--http HOST:PORT --status-token ...`")
    if args.mode == "dp":
        raise checks.InputError("--http applies to runs with a syncer; --mode dp has none")
    for i in range(shards):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", int(port) + i))
            except OSError as e:
                raise checks.InputError(f"--http 127.0.0.1:{int(port) + i}: cannot listen there: {e.strerror}") from None
    return f"127.0.0.1:{port}"


def save_built_in_model(train: TrainConfig, path: Path) -> None:
    """The built-in model exactly as every learner builds it from the seed, as a safetensors file."""
    from diloco.atomic import save_tensors
    from diloco.train.model import build_model

    state = build_model(train.model, train.seed).state_dict()
    save_tensors(path, {name: t.clone() for name, t in state.items()})  # clones: a tied head shares no storage


def network(args) -> tuple[float | None, float]:
    """(--link in bits per second or None, --link-latency-ms), checked before anything is written."""
    from diloco.run.links import MAX_WORKERS, check_can_shape, parse_link

    link = parse_link(args.link) if getattr(args, "link", None) else None
    latency = getattr(args, "link_latency_ms", None) or 0.0
    if not 0 <= latency < float("inf"):
        raise ValueError(f"--link-latency-ms must be a number of milliseconds ≥ 0, got {latency}")
    if latency and args.mode == "dp":
        raise ValueError("--link-latency-ms is added by a proxy between learners and the syncer; data-parallel "
                         "workers all-reduce with each other over gloo, which no proxy can carry (and this kernel has "
                         "no netem): --mode dp gets --link's bandwidth shaping only")
    if link is not None:
        if args.learners > MAX_WORKERS:
            raise ValueError(f"--link gives each of at most {MAX_WORKERS} learners a link; got --learners {args.learners}")
        check_can_shape()
    return link, latency


def budget_text(plan: Plan) -> str:
    paced = f", paced {plan.pace:.3f} s/step" if plan.pace else ""
    if plan.tokens:
        return f"budget {plan.tokens:,} tokens{paced}"
    if plan.steps:
        return f"budget {plan.steps} steps/learner{paced}"
    return f"budget {plan.duration:.0f}s{paced}"


def first_tokens(status: dict) -> bool:
    """Whether a learner has reported trained tokens: when the run's clock starts. Its heartbeats' claims, heard
    before any push backs them (/status `tokens_trained` counts only those)."""
    return status.get("tokens_claimed", status.get("tokens_trained", 0)) > 0


class Progress:
    """A live table on a terminal; a line every 15 s otherwise; nothing with --json or --no-progress.

    Its clock starts with the first trained tokens, as the report's wall-clock does: one duration for one run."""

    def __init__(self, plan: Plan, enabled: bool):
        self.plan, self.started = plan, None
        self.console = Console(stderr=True)
        self.enabled = enabled
        self.live = Live(console=self.console, refresh_per_second=4) if enabled and self.console.is_terminal else None
        self._last_line = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started is not None else 0.0

    def say(self, text: str) -> None:
        """A line of what the run is doing (on stderr; not with --json or --no-progress)."""
        if self.enabled:
            self.console.print(f"[{self.elapsed():5.0f}s] {text}", highlight=False)

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.__exit__(*exc)

    def update(self, status: dict | None) -> None:
        if self.started is None and status and first_tokens(status):
            self.started = time.monotonic()
        if not status or not self.enabled:
            return
        elapsed = self.elapsed()
        if self.live:
            self.live.update(progress_table(status, elapsed, budget_text(self.plan)))
        elif elapsed - self._last_line >= 15:
            self._last_line = elapsed
            losses = [f"{x['loss']:.3f}" for x in status.get("learners", []) if x.get("loss") is not None]
            self.console.print(f"[{elapsed:5.0f}s] rounds {status.get('rounds', 0)} tokens {status.get('tokens_trained', 0):,} "
                               f"losses {' '.join(losses)}")


class _DpWorkers:
    """What a fault injector may do to data-parallel workers: the launcher restarts the whole job on any death."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def kill(self, target: str) -> None:
        if target in self.procs and self.procs[target].poll() is None:
            self.procs[target].kill()

    def restart(self, target: str) -> None:
        pass  # the launcher already restarted every worker from the last checkpoint

    def pause(self, target: str) -> None:
        with_signal(self.procs.get(target), signal.SIGSTOP)

    def resume(self, target: str) -> None:
        with_signal(self.procs.get(target), signal.SIGCONT)

    def partition(self, target: str, seconds: float) -> None:
        raise RunFailed("data-parallel workers have no syncer link to partition")


def _dp_injector(plan: Plan):
    """An on_tick for run_dp that applies the plan's faults, timed from the first trained step."""
    workers = _DpWorkers()
    injector = Injector(plan.faults, workers)
    started = []

    def on_tick(procs):
        workers.procs = procs
        if not started and any((plan.out / "metrics").glob("*.jsonl")):
            started.append(time.monotonic())
            plan.fault_origin_unix = time.time()
        if started:
            injector.tick(time.monotonic() - started[0])
        plan.fault_timeline = injector.timeline

    return on_tick


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM to `diloco run` stops it as Ctrl-C does: every process at once, and the report is still written."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_local(args) -> int:
    plan = make_plan(args)
    progress = Progress(plan, enabled=not (args.json or args.no_progress))
    started = time.time()
    links = None
    if plan.link is not None:
        from diloco.run.links import ShapedLinks

        links = ShapedLinks(plan.learners, plan.link)
    with sigterm_as_interrupt():
        with links or contextlib.nullcontext():  # removed on every way out
            if links is not None and progress.enabled:
                progress.console.print(f"each {'worker' if plan.mode == 'dp' else 'learner'} behind its own link of "
                                       f"{link_text(plan)}: namespaces {links.links[0].namespace[:-2]}-*")
            if plan.mode == "dp":
                from diloco.run.dp_launch import run_dp

                learners, source = run_dp(plan, progress, on_tick=_dp_injector(plan) if plan.faults else None,
                                          links=links)
                interrupted = False
            else:
                learners, source, interrupted = _run_with_syncer(plan, progress, args.snapshots, plan.faults, links)
        if links is not None:  # counted as the links came down, after every process had stopped
            source["link_bytes"] = {f"learner-{i}": counts for i, counts in links.bytes.items()}
        progress.say(f"evaluating the global model at its snapshots for the report ({plan.out / 'syncer' / 'snapshots'})"
                     if plan.mode != "dp" else "evaluating the final model for the report")
        try:
            report = build_report(plan, learners, source, started)
        except Exception as e:  # noqa: BLE001 - an interrupted run stops with what it has, never with a traceback
            if not interrupted:
                raise
            Console(stderr=True).print(f"interrupted before a report could be built ({type(e).__name__}: {e}); run "
                                       f"directory {plan.out}: logs/, metrics/, syncer/", highlight=False)
            from diloco import exits

            return exits.INTERRUPTED
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_summary(report, Console())
    Console(stderr=True).print(
        f"{'interrupted; ' if interrupted else ''}run directory {plan.out}: report.json, model.safetensors, "
        f"eval_loss.png, sample.txt, logs/, metrics/", highlight=False, soft_wrap=True)
    if interrupted:
        from diloco import exits

        return exits.INTERRUPTED
    failed = [x["id"] for x in learners if x.get("exit_code")]
    return 1 if failed else 0


def _run_with_syncer(plan: Plan, progress: Progress, snapshots: int, chaos=None, links=None):
    syncer_dir = plan.out / "syncer"
    # the run stops its syncer once every learner is done: a learner restarted after a fault may join late
    syncer_args = ["--sync-config", str(plan.out / "sync_config.json"), "--no-exit-when-done"]
    if plan.initial_model:
        syncer_args += ["--initial-model", str(plan.initial_model)]
    if plan.tokens:
        syncer_args += ["--tokens", str(plan.tokens)]
    if plan.duration:
        syncer_args += ["--duration", str(plan.duration), "--snapshot-every", str(plan.duration / max(snapshots, 1))]
    else:  # token or step budgets: snapshot by tokens trained
        total = plan.tokens or plan.steps * plan.learners * plan.train.tokens_per_step()
        syncer_args += ["--snapshot-tokens", str(max(1, total // max(snapshots, 1)))]
    learner_args = {}
    for i, speed in enumerate(plan.speeds):
        lid = f"learner-{i}"
        learner_args[lid] = ["--shard", str(i), "--num-shards", str(plan.learners), "--speed", str(speed),
                             "--train-config", str(plan.out / "train_config.json"),
                             "--metrics", str(plan.out / "metrics" / f"{lid}.jsonl"),
                             "--summary", str(plan.out / "learners" / f"{lid}.json"), "--connect-timeout", "120",
                             "--optimizer-state", str(plan.out / "learners" / f"{lid}.optimizer.pt")]
        if plan.steps:
            learner_args[lid] += ["--max-steps", str(plan.steps)]
        if plan.pace:
            learner_args[lid] += ["--pace", str(plan.pace)]
        if plan.tensorboard:
            learner_args[lid] += ["--tensorboard", str(plan.tensorboard)]
    faults = chaos or []
    n = plan.syncer_shards
    shard_dirs = [syncer_dir] if n == 1 else [syncer_dir / f"shard-{i}" for i in range(n)]
    per_shard = [["--state", str(d), *syncer_args, *([] if n == 1 else ["--shard", f"{i}/{n}"])]
                 for i, d in enumerate(shard_dirs)]
    cluster = LocalCluster(plan.out, per_shard, learner_args, proxies=any(f.kind == "partition" for f in faults),
                           ranks_per_learner=plan.ranks_per_learner, links=links, latency_ms=plan.link_latency_ms,
                           http=getattr(plan, "http", None))
    tape = None
    if faults:  # the faults on a tape beside the syncer's: `diloco inspect syncer/tape.jsonl faults.jsonl`
        from diloco.syncer.observation.tape import Tape

        tape = Tape(plan.out / "faults.jsonl")

    def announce(event: str, t: float, fault) -> None:  # the fault on every shard's dashboard
        note = {"kind": "fault", "event": event, "fault": fault.kind, "target": fault.target, "seconds": round(t, 3),
                "duration": fault.duration}
        for port in cluster.http_ports:
            annotations.post(f"127.0.0.1:{port}", note, timeout=1.0)

    injector = Injector(faults, cluster, tape, on_event=announce)
    live, interrupted = None, False
    try:
        cluster.start()
        if n == 1:  # the global model's held-out loss on the dashboard as snapshots appear (shards: after the run)
            live = LiveEval(plan.train, syncer_dir / "snapshots", plan.out, cluster.http_ports).start()
        if progress.enabled:
            progress.console.print(
                f"syncer{' shards' if n > 1 else ''} on {cluster.address}; add a learner with `diloco learner "
                f"--syncer {cluster.address} --id NAME --train-config {plan.out / 'train_config.json'}`, "
                "remove one with SIGTERM")
            progress.console.print("dashboard: " + ", ".join(f"http://127.0.0.1:{p}/" for p in cluster.http_ports))
        started, spent = None, False  # fault times count from the first trained tokens, not from process start-up
        with progress:
            while True:
                status = cluster.status()
                if started is None and status and first_tokens(status):
                    started = time.monotonic()
                    plan.fault_origin_unix = time.time()
                if status and status.get("stopping"):
                    if not spent:
                        spent = True
                        progress.say("the budget is spent: every learner pushes what it has left and leaves")
                    injector.finish()  # nothing more to break or restart
                elif started is not None:
                    injector.tick(time.monotonic() - started)
                restarting = any(f.kind in ("kill", "syncer-crash") for _, f in injector.active)
                if not cluster.learners_running() and not restarting:
                    break
                progress.update(status)
                time.sleep(0.25)
            progress.update(cluster.status())
        injector.finish()
        progress.say("every learner has left; the syncer saves the final model")
    except ClusterError as e:
        raise RunFailed(str(e)) from None
    except KeyboardInterrupt:
        interrupted = True
        injector.finish()
        Console(stderr=True).print(f"[{progress.elapsed():5.0f}s] interrupted: every learner pushes what it has left "
                                   "and leaves, then the syncer saves the model; Ctrl-C again stops them at once",
                                   highlight=False)
    finally:
        if live is not None:
            live.stop()
        cluster.shutdown()
        if tape is not None:
            tape.close()
    learners = collect_summaries(plan, cluster.procs)
    for i, d in enumerate(shard_dirs):
        if interrupted and not (d / "syncer.json").exists():
            Console(stderr=True).print(f"interrupted before the syncer had a model to save; logs in {plan.out / 'logs'}")
            raise KeyboardInterrupt
        if not (d / "syncer.json").exists():
            name = "syncer" if n == 1 else f"syncer-{i}"
            raise RunFailed(f"the {name} wrote no final state; see {plan.out / 'logs' / (name + '.log')}")
    if n > 1:  # the shards' outputs as one syncer's, where the report reads them
        from diloco.run.shards import combine_outputs

        combine_outputs(shard_dirs, syncer_dir)
    source = json.loads((syncer_dir / "syncer.json").read_text())
    source["faults"] = injector.timeline
    return learners, source, interrupted
