"""`diloco compare`: several modes under one budget and one fault scenario, side by side."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from diloco import checks, procs



def register(sub) -> None:
    from diloco.options import add_config_options
    from diloco.run.run_command import add_network_options

    p = sub.add_parser("compare", help="run several modes under one budget and fault scenario, side by side",
                       description="Each mode is one `diloco run` with the same model, data, seed, budget and faults; "
                                   "the table compares goodput, uptime, final held-out loss and wire bytes.")
    p.add_argument("--modes", default="decoupled,diloco,dp", help="comma-separated; the first is the reference")
    p.add_argument("--learners", "-M", type=int, default=4, help="learners (dp: workers) of every mode (4)")
    b = p.add_argument_group("budget, the same for every mode (default: --duration 120)")
    b.add_argument("--duration", type=float, help="seconds of training per mode (tokens then differ: each mode trains "
                                                  "as fast as it can)")
    b.add_argument("--tokens", type=int, help="tokens per mode, rounded up to whole steps of every learner so that "
                                              "every mode trains exactly as many (not with --chaos)")
    b.add_argument("--pace", metavar="SECONDS|auto|off",
                   help="pace every mode's steps alike (see `diloco run --pace`; default: auto with --chaos, measured "
                        "once for all modes)")
    m = p.add_argument_group("model and data")
    m.add_argument("--model", choices=("small", "tiny"), default="small", help="built-in model size (small)")
    m.add_argument("--seed", type=int, default=0, help="seed of the model initialisation and data order (0)")
    c = p.add_argument_group("faults")
    c.add_argument("--chaos", metavar="SCENARIO", help="the same fault scenario for every mode (see `diloco run`)")
    add_network_options(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="folder for one run directory per mode (default runs/compare-<time>)")
    add_config_options(p)
    p.set_defaults(func=cmd_compare)


def same_budget(args, tokens_per_step: int) -> tuple[list[str], str]:
    """The budget flags every mode's `diloco run` gets, and the line that says what they mean. A token budget
    becomes whole steps per learner: a syncer's token budget reaches learners through heartbeats, so decoupled
    learners would train a few steps past it, while dp's workers stop at an exact step count."""
    if args.duration:
        return ["--duration", str(args.duration)], (f"same budget: {args.duration:g} s of training per mode (tokens "
                                                    f"differ: each mode trains as fast as it can)")
    per_round = args.learners * tokens_per_step
    steps = -(-args.tokens // per_round)
    exact = "" if steps * per_round == args.tokens else f" (--tokens {args.tokens:,} rounded up to whole steps)"
    return ["--steps", str(steps)], (f"same budget: {steps} steps × {args.learners} learners × {tokens_per_step:,} "
                                     f"tokens = {steps * per_round:,} tokens per mode{exact}")


def cmd_compare(args) -> int:
    from diloco.config import MODES
    from diloco.run.pacing import auto_pace, parse_pace

    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r} in --modes; choose from {', '.join(MODES)}")
    if args.duration is not None and args.tokens is not None:
        raise ValueError("give one budget: --duration or --tokens")
    if args.tokens is not None and args.chaos:
        raise ValueError("--tokens with --chaos: killed learners restart their step counts, so only a --duration "
                         "budget is the same for every mode")
    for flag in ("duration", "tokens", "learners"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise ValueError(f"--{flag} must be positive, got {getattr(args, flag)}")
    if args.duration is None and args.tokens is None:
        args.duration = 120.0
    link, latency = [], []
    if args.link:
        from diloco.run.links import check_can_shape, parse_link

        if parse_link(args.link) is not None:  # refused now, not after the first mode's run
            check_can_shape()
        link = ["--link", args.link]
    if args.link_latency_ms is not None:  # dp runs without it: no proxy can carry its gloo traffic
        if not 0 <= args.link_latency_ms < float("inf"):
            raise ValueError(f"--link-latency-ms must be a number of milliseconds ≥ 0, got {args.link_latency_ms}")
        latency = ["--link-latency-ms", str(args.link_latency_ms)]
    out = args.out or Path("runs") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    checks.writable_dir("--out", out)
    from diloco.options import train_config

    train = train_config(argparse.Namespace(seed=args.seed, model=args.model))
    budget, budget_line = same_budget(args, train.tokens_per_step())
    pace = parse_pace(args.pace)
    if pace == "auto" or (pace is None and args.chaos):  # one pace for every mode: the same capacities
        pace = auto_pace(train, args.learners + 1)
    if pace is not None:
        budget += ["--pace", str(pace)]
    reports, console = {}, Console(stderr=True)
    console.print(budget_line)
    for mode in modes:
        cmd = [sys.executable, "-m", "diloco", "run", "--mode", mode, "--learners", str(args.learners), *budget,
               "--model", args.model, "--seed", str(args.seed), "--json", "--out", str(out / mode)]
        if args.chaos:
            cmd += ["--chaos", args.chaos]
        cmd += link if mode == "dp" else link + latency
        console.print(f"[bold]{mode}[/bold]: {' '.join(cmd[3:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=procs.child_env(),
                              preexec_fn=procs.die_with_parent())  # ends with this process, even on SIGKILL
        if proc.returncode != 0:
            console.print(proc.stderr[-2000:])
            raise ValueError(f"the {mode} run failed (exit {proc.returncode}); its logs are in {out / mode / 'logs'}")
        reports[mode] = json.loads(proc.stdout)
    print_table(reports, args.chaos)
    console.print(budget_line)
    if latency and "dp" in modes:
        console.print("dp ran without --link-latency-ms: no proxy can carry its gloo traffic (bandwidth shaping only)")
    summary = {m: {k: r.get(k) for k in ("goodput", "uptime", "final_eval_loss", "initial_eval_loss", "wire_bytes",
                                          "tokens_trained", "tokens_merged", "wall_seconds", "chaos", "link",
                                          "link_bytes_total")}
               for m, r in reports.items()}
    (out / "compare.json").write_text(json.dumps({"budget": budget_line, "modes": summary}, indent=2))
    console.print(f"run directories, timelines and compare.json in {out}")
    return 0


def print_table(reports: dict[str, dict], chaos: str | None) -> None:
    ref = next(iter(reports.values()))
    links = any("link_bytes_total" in r for r in reports.values())
    title = f"{len(reports)} modes" + (f" under {chaos}" if chaos else "")
    table = Table(title=title + (f" over links of {ref['link']}" if ref.get("link") else ""), title_justify="left")
    for col in ("mode", "goodput", "uptime", "final loss", "vs first", "wire bytes", "first / this", "tokens merged",
                *(["link bytes"] if links else [])):
        table.add_column(col, justify="right")
    for mode, r in reports.items():
        table.add_row(mode, f"{r['goodput']:.3f}", f"{r['uptime']:.3f}", f"{r['final_eval_loss']:.4f}",
                      f"{100 * (r['final_eval_loss'] / ref['final_eval_loss'] - 1):+.1f}%", f"{r['wire_bytes']:,}",
                      f"{ref['wire_bytes'] / max(r['wire_bytes'], 1):,.2f}×", f"{r['tokens_merged']:,}",
                      *([f"{r.get('link_bytes_total', 0):,}"] if links else []))
    console = Console()
    if not console.is_terminal:  # piped to a file: no terminal width to fit, so do not squeeze the figures
        console = Console(width=160)
    console.print(table)
