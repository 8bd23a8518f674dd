"""What costs decoupled mode tokens against data-parallel: tokens to dp's quality, per variant of the settings.

    python -m benchmarks.quality.token_gap --model tiny --tokens 1600000 --seeds 0,1 \\
        --variant default= --variant H12="--sync-every 12 --fragments 12" --json runs/token_gap.json
    python -m benchmarks.quality.token_gap --markdown runs/token_gap.json

dp runs once per seed on loopback with the budget; T is its final held-out loss × (1 + --margin). Every variant is a
`diloco run` of --mode (decoupled) with the same model, data, seed and budget plus the variant's flags; the table
reports tokens to T ÷ dp's tokens to T (the figure that divides every speed-up over slow links: benchmarks/links/wan.py),
the final loss against dp's, and dp's wire bytes to T over the variant's (the syncer's count at each eval snapshot,
interpolated like tokens; dp's ring all-reduce bytes pro rata, in fp32 and, halved, in bf16), each as the mean over
seeds with its range. Links play no part: tokens to T do not
depend on them. The sweep is written to --json after every run and resumes from it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from benchmarks.links.wan import first_reach, run_once

from diloco.algorithm.codec import BLOCK, SCALE_BYTES
from diloco.run.report import OVERSHOOT_WARNING
from benchmarks.provenance import stamped


def ratio_rows(results: dict, margin: float) -> list[dict]:
    """Per variant: tokens to T over dp's (per seed) and final loss minus dp's, where T = dp's final × (1 + margin)."""
    rows = []
    for name in results["variants"]:
        ratios, deltas, finals, byte_ratios = [], [], [], []
        for seed in results["seeds"]:
            dp, run = results["runs"].get(f"dp@{seed}"), results["runs"].get(f"{name}@{seed}")
            if not dp or not run:
                continue
            t = dp["final_loss"] * (1 + margin)
            dp_reach, reach = first_reach(dp["curve"], t), first_reach(run["curve"], t)
            ratios.append(reach["tokens"] / dp_reach["tokens"] if reach and dp_reach else float("inf"))
            deltas.append(run["final_loss"] - dp["final_loss"])
            finals.append(run["final_loss"])
            if reach and dp_reach and reach.get("wire_bytes"):
                byte_ratios.append(dp_bytes_to(dp, dp_reach["tokens"]) / reach["wire_bytes"])
        if ratios:
            budget = results.get("tokens")
            trained = [results["runs"][f"{name}@{seed}"].get("tokens_trained", 0) / budget
                       for seed in results["seeds"] if budget and f"{name}@{seed}" in results["runs"]]
            rows.append({"variant": name, "flags": results["variants"][name], "tokens_ratio": ratios,
                         "trained_over_budget": max(trained, default=0.0),
                         "final_minus_dp": deltas, "final": finals,
                         "fp32_dp_bytes_ratio": byte_ratios if len(byte_ratios) == len(ratios) else None})
    return rows


def dp_bytes_to(dp: dict, tokens: float) -> float:
    """fp32 data-parallel's wire bytes to `tokens`: its ring all-reduce bytes (the same every step) pro rata."""
    return dp["wire_bytes"] * tokens / dp["tokens_trained"]


def spread(xs: list[float], fmt: str) -> str:
    mid = statistics.fmean(xs)
    return f"{mid:{fmt}} ({min(xs):{fmt}}–{max(xs):{fmt}})" if len(xs) > 1 else f"{mid:{fmt}}"


def ratio_cell(ratios: list[float]) -> str:
    """Tokens-to-T ratios over seeds; a seed whose run never reached T is counted, not averaged."""
    reached = [x for x in ratios if x != float("inf")]
    if len(reached) == len(ratios):
        return spread(ratios, ".2f") + "×"
    text = f"not reached in {len(ratios) - len(reached)} of {len(ratios)} seeds"
    return text + ("; " + ", ".join(f"{x:.2f}×" for x in reached) if reached else "")


def markdown(results: dict, margin: float) -> str:
    dp_final = [results["runs"][f"dp@{s}"]["final_loss"] for s in results["seeds"] if f"dp@{s}" in results["runs"]]
    lines = [f"dp's final loss {spread(dp_final, '.4f')}; T = dp's final × {1 + margin:g}, per seed.", "",
             "| variant | flags | tokens to T ÷ dp's | final loss − dp's | wire bytes to T: bf16 dp's ÷ the variant's "
             "(fp32 dp's) |", "|---|---|---|---|---|"]
    for r in ratio_rows(results, margin):
        fp32 = r["fp32_dp_bytes_ratio"]
        # a run that trained well past its budget is no equal-token comparison (report.py's run_warnings says why)
        over = (f" **trained up to {r['trained_over_budget']:.2f}× the budget: not at equal tokens**"
                if r["trained_over_budget"] > OVERSHOOT_WARNING else "")
        lines.append(f"| {r['variant']} | `{r['flags'] or '(defaults)'}`{over} | {ratio_cell(r['tokens_ratio'])} | "
                     f"{spread(r['final_minus_dp'], '+.4f')} | "
                     f"{spread([x / 2 for x in fp32], '.0f') + '× (' + spread(fp32, '.0f') + '×)' if fp32 else '–'} |")
    return "\n".join(lines)


def parts_markdown(results: dict) -> str:
    """Where each run's wire bytes went (the syncer's count by call and part), seed by seed."""
    lines = ["| run | wire MB | pushes | downlink | joins and the initial upload | heartbeats | framing (all calls) | "
             "block scales (int codecs) |", "|---|---|---|---|---|---|---|---|"]
    for key, run in results["runs"].items():
        parts = run.get("wire_parts")
        if not parts:
            continue
        total = run["wire_bytes"]
        by_rpc = {rpc: sum(p.values()) for rpc, p in parts.items()}
        framing = sum(p.get("framing", 0) for p in parts.values())
        scales = sum(n * SCALE_SHARE.get(part.removeprefix("payload:"), 0.0)
                     for p in parts.values() for part, n in p.items())
        share = lambda n: f"{100 * n / total:.1f}%"  # noqa: E731
        lines.append(f"| {key} | {total / 1e6:.2f} | {share(by_rpc.get('push', 0))} | {share(by_rpc.get('downlink', 0))} "
                     f"| {share(by_rpc.get('join', 0) + by_rpc.get('init', 0))} | {share(by_rpc.get('heartbeat', 0))} "
                     f"| {share(framing)} | {share(scales)} |")
    return "\n".join(lines)


SCALE_SHARE = {"int8": SCALE_BYTES / (SCALE_BYTES + BLOCK), "int4": SCALE_BYTES / (SCALE_BYTES + BLOCK // 2)}
"""Share of an int8 / int4 payload that is block scales: one scale per block of BLOCK values, up to the last
block's padding. Runs recorded before the scales became bf16 had 4-byte scales (twice these shares)."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "small"))
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1_600_000, help="token budget of every run (1,600,000)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (0)")
    p.add_argument("--mode", default="decoupled", choices=("decoupled", "streaming", "diloco"))
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="a variant: its name and the `diloco run` flags it adds (repeatable; default=… for none)")
    p.add_argument("--margin", type=float, default=0.05, help="T = dp's final loss × (1 + margin) (0.05)")
    p.add_argument("--snapshots", type=int, default=20, help="eval points per run (20)")
    p.add_argument("--json", type=Path, help="where the sweep is kept (and resumed from)")
    p.add_argument("--markdown", type=Path, metavar="JSON", help="print the table of a sweep and exit")
    args = p.parse_args()
    if args.markdown:
        results = json.loads(args.markdown.read_text())
        print(markdown(results, args.margin) + "\n\n" + parts_markdown(results))
        return 0
    variants = {}
    for v in args.variant or ["default="]:
        name, sep, flags = v.partition("=")
        if not sep or not name:
            p.error(f"--variant wants NAME=FLAGS, got {v!r}")
        variants[name] = flags
    seeds = [int(s) for s in args.seeds.split(",")]
    results = json.loads(args.json.read_text()) if args.json and args.json.exists() else {"runs": {}}
    results.update(model=args.model, tokens=args.tokens, seeds=sorted(set(results.get("seeds", [])) | set(seeds)),
                   variants={**results.get("variants", {}), **variants})
    out = Path("runs") / "token_gap"
    args.speeds = args.chaos = args.pace = None  # run_once's other knobs: none here
    for seed in seeds:
        args.seed = seed
        todo = [("dp", "dp", "")] + [(name, args.mode, flags) for name, flags in variants.items()]
        for name, mode, flags in todo:
            key = f"{name}@{seed}"
            if key in results["runs"]:
                continue
            print(f"running {key} ({mode} {flags})", file=sys.stderr, flush=True)
            results["runs"][key] = run_once(mode, "none", ["--tokens", str(args.tokens)], args, shlex.split(flags),
                                            out / f"{name}-s{seed}")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(stamped(results, args), indent=1))
    print(markdown(results, args.margin) + "\n\n" + parts_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
