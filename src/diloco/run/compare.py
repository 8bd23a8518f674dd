"""`diloco compare`: several modes under one budget and one fault scenario, side by side."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from diloco.config import MODES
from diloco.run.pacing import auto_pace, parse_pace


def register(sub) -> None:
    p = sub.add_parser("compare", help="run several modes under one budget and fault scenario, side by side",
                       description="Each mode is one `diloco run` with the same model, data, seed, budget and faults; "
                                   "the table compares goodput, uptime, final held-out loss and wire bytes.")
    p.add_argument("--modes", default="decoupled,diloco,dp", help="comma-separated; the first is the reference")
    p.add_argument("--learners", "-M", type=int, default=4)
    p.add_argument("--duration", type=float, help="seconds of training per mode")
    p.add_argument("--tokens", type=int, help="tokens per mode (not with --chaos)")
    p.add_argument("--chaos", metavar="SCENARIO", help="the same fault scenario for every mode (see `diloco run`)")
    p.add_argument("--model", choices=("small", "tiny"), default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pace", metavar="SECONDS|auto|off",
                   help="pace every mode's steps alike (see `diloco run --pace`; default: auto with --chaos, measured "
                        "once for all modes)")
    p.add_argument("--out", type=Path, help="folder for one run directory per mode (default runs/compare-<time>)")
    from diloco.run.cli import add_network_options

    add_network_options(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r} in --modes; choose from {', '.join(MODES)}")
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
    budget = ["--duration", str(args.duration)] if args.duration else ["--tokens", str(args.tokens)]
    pace = parse_pace(args.pace)
    if pace == "auto" or (pace is None and args.chaos):  # one pace for every mode: the same capacities
        from diloco.cli import train_config
        from diloco.run.local import TINY

        train = train_config(argparse.Namespace(seed=args.seed))
        if args.model == "tiny":
            train = replace(train, model=TINY)
        pace = auto_pace(train, args.learners + 1)
    if pace is not None:
        budget += ["--pace", str(pace)]
    reports, console = {}, Console(stderr=True)
    for mode in modes:
        cmd = [sys.executable, "-m", "diloco", "run", "--mode", mode, "--learners", str(args.learners), *budget,
               "--model", args.model, "--seed", str(args.seed), "--json", "--out", str(out / mode)]
        if args.chaos:
            cmd += ["--chaos", args.chaos]
        cmd += link if mode == "dp" else link + latency
        console.print(f"[bold]{mode}[/bold]: {' '.join(cmd[3:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            console.print(proc.stderr[-2000:])
            raise ValueError(f"the {mode} run failed (exit {proc.returncode}); its logs are in {out / mode / 'logs'}")
        reports[mode] = json.loads(proc.stdout)
    print_table(reports, args.chaos)
    if latency and "dp" in modes:
        console.print("dp ran without --link-latency-ms: no proxy can carry its gloo traffic (bandwidth shaping only)")
    summary = {m: {k: r.get(k) for k in ("goodput", "uptime", "final_eval_loss", "initial_eval_loss", "wire_bytes",
                                          "tokens_trained", "tokens_merged", "wall_seconds", "chaos", "link",
                                          "link_bytes_total")}
               for m, r in reports.items()}
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
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
