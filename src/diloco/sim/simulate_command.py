"""`diloco simulate goodput` and `diloco simulate bandwidth`."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from rich.console import Console

from diloco.sim import bandwidth as bw
from diloco.sim import bandwidth_view, goodput_view
from diloco.sim.from_run import ReportError, load_run, project
from diloco.sim.world import field_names, override
from diloco.sim.presets import PRESETS, PUBLISHED_PRESET
from diloco.sim.strategies import STRATEGIES
from diloco.sim.sweep import cells_for, expected_events, run_sweep

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
DEFAULT_CHIPS = "150k,300k,600k,1.2M,2.4M"
# Simulation events per second of CPU (the default sweep, about 9M events, takes 2.3 s here); sweeps expected
# to take longer than about a second show a progress bar.
_EVENTS_PER_SECOND = 3_000_000


def _stdout_console() -> Console:
    console = Console()
    # Piped output is not wrapped at 80 columns, so wide tables stay readable in files and logs.
    return console if console.is_terminal else Console(width=160)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="goodput and bandwidth at scale",
                       description="Simulate goodput under failures at scale, or the bandwidth each method needs.")
    kinds = p.add_subparsers(dest="simulation", metavar="SIMULATION")
    kinds.required = True
    _add_goodput(kinds)
    _add_bandwidth(kinds)


def _number(text: str) -> float:
    t = text.strip().lower().replace("_", "")
    scale = _SUFFIX.get(t[-1:], 1.0)
    value = float(t[:-1] if t[-1:] in _SUFFIX else t) * scale
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _list(kind):
    def parse(text: str):
        try:
            values = [kind(_number(x)) if kind is not str else x.strip() for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        if kind is not str and any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"values must be positive: {text!r}")
        return values
    return parse


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(_number(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
        return value
    return parse


def _seed(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"not a non-negative integer: {text!r}")
    return int(text)


def _add_goodput(kinds) -> None:
    g = kinds.add_parser("goodput", help="goodput and uptime of each strategy under chip failures",
                         description="Discrete-event simulation of chips failing in slices; goodput and uptime "
                                     "for every (strategy, chips, learners) cell.")
    g.add_argument("--preset", default=PUBLISHED_PRESET, choices=sorted(PRESETS),
                   help="constant set (default: %(default)s)")
    g.add_argument("--chips", type=_list(int), default=_list(int)(DEFAULT_CHIPS),
                   help=f"chip counts, k/M suffixes allowed (default: {DEFAULT_CHIPS})")
    g.add_argument("--learners", type=_list(int), default=[8, 16],
                   help="learner counts for diloco and decoupled (default: 8,16)")
    g.add_argument("--strategies", type=_list(str), default=list(STRATEGIES),
                   help=f"any of {','.join(STRATEGIES)} (default: all)")
    g.add_argument("--days", type=_positive(float), default=3.0, help="simulated days per run (default: 3)")
    g.add_argument("--repeats", type=_positive(int), default=5,
                   help="independent runs per cell, for the 95%% interval (default: 5)")
    g.add_argument("--seed", type=_seed, default=0, help="random seed, a non-negative integer (default: 0)")
    g.add_argument("--jobs", type=_positive(int), default=os.cpu_count() or 1,
                   help="worker processes; results do not depend on it (default: one per CPU)")
    g.add_argument("--quorum", type=_positive(int), help="Decoupled DiLoCo quorum K (default: preset's)")
    g.add_argument("--grace", help="Decoupled DiLoCo grace window in seconds, or 'adaptive'")
    g.add_argument("--failures-in-pauses", action="store_true",
                   help="let chips fail while their unit is paused or restarting")
    g.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override one model constant, e.g. --set repair_seconds=3600 (see docs/simulation.md)")
    g.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    g.add_argument("--plot", metavar="FILE", help="save goodput against chips to FILE (png, svg, pdf)")
    g.set_defaults(func=_goodput, parser=g)


def _model_from_args(args):
    preset = PRESETS[args.preset]
    assignments = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in field_names():
            args.parser.error(f"--set expects NAME=VALUE with NAME one of: {', '.join(sorted(field_names()))}")
        assignments[name.strip()] = value.strip()
    if args.quorum is not None:
        assignments["quorum"] = str(args.quorum)
    if args.grace is not None:
        assignments["grace_seconds"] = args.grace
    if args.failures_in_pauses:
        assignments["failures_in_pauses"] = "true"
    try:
        fm, tm = override(preset.failures, assignments), override(preset.training, assignments)
        fm.validate()
        tm.validate()
    except ValueError as exc:
        args.parser.error(str(exc))
    return preset, fm, tm


def _goodput(args) -> int:
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        args.parser.error(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    preset, fm, tm = _model_from_args(args)
    cells = cells_for(args.strategies, args.chips, args.learners)
    smallest = min(c.chips / c.learners for c in cells)
    if smallest < fm.slice_chips:
        args.parser.error(f"a learner of {smallest:g} chips is smaller than one slice ({fm.slice_chips} chips)")
    if any(tm.quorum > c.learners for c in cells if c.strategy == "decoupled"):
        args.parser.error(f"quorum {tm.quorum} exceeds a learner count in --learners")
    horizon = args.days * 86400.0
    err = Console(stderr=True)
    slow = expected_events(cells, fm, tm, horizon, args.repeats) > _EVENTS_PER_SECOND
    started = time.perf_counter()
    if slow:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("simulating"), BarColumn(), TextColumn("{task.completed}/{task.total} cells"),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("sweep", total=len(cells))
            results = run_sweep(cells, fm, tm, horizon, args.repeats, args.seed,
                                on_cell=lambda _: progress.advance(task), jobs=args.jobs)
    else:
        results = run_sweep(cells, fm, tm, horizon, args.repeats, args.seed, jobs=args.jobs)
    elapsed = time.perf_counter() - started
    published = preset.name == PUBLISHED_PRESET and fm == PRESETS[PUBLISHED_PRESET].failures
    title = (f"{preset.name}: {args.days:g} simulated days x {args.repeats} runs, seed {args.seed} "
             f"({elapsed:.1f} s)")
    if args.json:
        rows = goodput_view.to_rows(results, preset.name, args.days, args.seed, published)
        print(json.dumps(rows, indent=1))
    else:
        goodput_view.render_table(results, _stdout_console(), title=title, show_published=published)
    if args.plot:
        try:
            goodput_view.plot(results, args.plot, title=f"{preset.name}, {args.days:g} days x {args.repeats} runs",
                              show_published=published)
        except (OSError, ValueError) as exc:
            return _fail("goodput", f"cannot write the plot: {exc}")
        err.print(f"plot written to {args.plot}")
    return 0


def _add_bandwidth(kinds) -> None:
    b = kinds.add_parser("bandwidth", help="compute utilisation against link bandwidth, per method",
                         description="Bandwidth each method needs between datacenters, and the utilisation a "
                                     "given link allows; or a projection of a real run with --from-run.")
    b.add_argument("--params", type=_list(float),
                   help="model parameters, B/M suffixes allowed, e.g. 1B,10B,100B (default: 5B)")
    b.add_argument("--step-seconds", type=_list(float),
                   help="healthy step time, one value or one per --params (default: 1; "
                        "with --from-run: the run's, scaled with the parameter count)")
    b.add_argument("--datacenters", type=_positive(int), default=8, help="datacenters D (default: 8)")
    b.add_argument("--methods", type=_list(str), default=list(bw.METHODS),
                   help=f"any of {','.join(bw.METHODS)} (default: all)")
    b.add_argument("--fragments", type=_positive(int), default=24, help="P (default: 24)")
    b.add_argument("--sync-every", type=_positive(int), default=24, help="H (default: 24)")
    b.add_argument("--overlap", type=int, default=2, help="tau, steps (default: 2)")
    b.add_argument("--codec", choices=sorted(bw.CODEC_BITS), default="int4",
                   help="codec of streaming and decoupled (dp and diloco use bf16; default: int4)")
    b.add_argument("--backward-fraction", type=float, default=2 / 3,
                   help="share of a step data-parallel hides its all-reduce in (default: 2/3)")
    b.add_argument("--target", type=_list(float), default=[0.95, 1.0],
                   help="utilisation targets for the required bandwidth (default: 0.95,1; --from-run uses the first)")
    b.add_argument("--gbps", type=_list(float), default=[1.0, 10.0, 100.0],
                   help="link speeds to report utilisation at (default: 1,10,100; --from-run uses the first)")
    b.add_argument("--from-run", metavar="DIR", help="project a `diloco run` directory (its report.json)")
    b.add_argument("--learners", type=_positive(int), help="with --from-run: learners to project to")
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    b.add_argument("--plot", metavar="FILE", help="save utilisation against bandwidth to FILE")
    b.set_defaults(func=_bandwidth, parser=b)


def _bandwidth(args) -> int:
    unknown = [m for m in args.methods if m not in bw.METHODS]
    if unknown:
        args.parser.error(f"unknown method {unknown[0]!r}; choose from {', '.join(bw.METHODS)}")
    if any(not 0 < t <= 1 for t in args.target):
        args.parser.error("--target values must be in (0, 1]")
    if args.overlap < 0:
        args.parser.error("--overlap must not be negative")
    if args.from_run:
        return _from_run(args)
    params = args.params or [5e9]
    steps = args.step_seconds or [1.0]
    if len(steps) == 1:
        steps = steps * len(params)
    if len(steps) != len(params):
        args.parser.error("--step-seconds needs one value or one per --params value")
    try:
        workloads = [bw.Workload(n, t, args.datacenters, args.backward_fraction) for n, t in zip(params, steps)]
        for w in workloads:
            w.validate()
    except ValueError as exc:
        args.parser.error(str(exc))
    methods = [bw.default_method(k, fragments=args.fragments, sync_every=args.sync_every,
                                 overlap_steps=args.overlap, codec=args.codec if k in ("streaming", "decoupled")
                                 else None) for k in args.methods]
    rows = bandwidth_view.to_rows(methods, workloads, args.target, args.gbps)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        bandwidth_view.render_table(rows, args.target, args.gbps, _stdout_console())
    if args.plot:
        try:
            bandwidth_view.plot(methods, workloads[0], args.plot)
        except (OSError, ValueError) as exc:
            return _fail("bandwidth", f"cannot write the plot: {exc}")
        Console(stderr=True).print(f"plot written to {args.plot}")
    return 0


def _from_run(args) -> int:
    if (args.params and len(args.params) > 1) or (args.step_seconds and len(args.step_seconds) > 1):
        args.parser.error("--from-run projects to one --params and --step-seconds value")
    try:
        run = load_run(args.from_run)
        projection = project(run, parameters=args.params[0] if args.params else None,
                             learners=args.learners, gbps=args.gbps[0],
                             step_seconds=args.step_seconds[0] if args.step_seconds else None,
                             target=args.target[0])
    except (ReportError, ValueError) as exc:
        return _fail("bandwidth", str(exc))
    if args.json:
        print(json.dumps(bandwidth_view.projection_row(projection), indent=1))
    else:
        bandwidth_view.render_projection(projection, _stdout_console())
    return 0


def _fail(command: str, message: str) -> int:
    print(f"diloco simulate {command}: error: {message}", file=sys.stderr)
    return 2
