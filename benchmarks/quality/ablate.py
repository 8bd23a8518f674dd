"""Ablation of this project's additions to the published algorithm: the paper preset, each addition put on it
one at a time, the defaults, and each addition taken off them one at a time — at equal allocated tokens
(every learner paced alike for the same duration), several seeds, on two settings:

- equal: 4 learners of equal speed;
- hetero: speeds 1,1,0.5,0.25 and one learner (chosen by the seed) killed for a fifth of the run.

    python -m benchmarks.quality.ablate --model tiny --duration 30 --seeds 0,1,2 --json runs/ablate.json

Each run is one `diloco run --json` in decoupled mode; the table gives the held-out loss (mean ± half the range
over seeds), the tokens trained and goodput. A run costs the duration plus about 15 s of start-up and evaluation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped

MECHANISMS = {
    # name: (flags that turn it on over the paper preset, flags that turn it off under the defaults)
    "keep-overlap": (["--keep-overlap"], ["--no-keep-overlap"]),
    "align-pushes": (["--align-pushes"], ["--no-align-pushes"]),
    "predicted-pushes": (["--grace-expect-steps", "6"], ["--grace-expect-steps", "0"]),
    # rounds open for the peers predicted within a cycle, learners keeping their progress meanwhile
    "wait-for-peers": (["--keep-overlap", "--grace-expect-steps", "24"], ["--no-keep-overlap", "--grace-expect-steps", "0"]),
    "partial-round-scaling": (["--scale-partial-rounds"], ["--no-scale-partial-rounds"]),
    "delayed-momentum": (["--delayed-momentum"], ["--no-delayed-momentum"]),
    "long-contribution-clamp": (["--clamp-long-contributions"], ["--no-clamp-long-contributions"]),
    "outlier-refusal": (["--max-norm-ratio", "50", "--norm-ceiling", "1"], ["--max-norm-ratio", "0", "--norm-ceiling", "0"]),
    "counter-bounds": (["--max-counter-ratio", "4"], ["--max-counter-ratio", "0"]),
    "round-bound": (["--max-round-ratio", "10"], ["--max-round-ratio", "0"]),
    "robust-clip": (["--clip-norm-ratio", "4"], ["--clip-norm-ratio", "0"]),
    "outer-lr1-mu0": (["--outer-lr", "1", "--outer-momentum", "0"], ["--outer-lr", "0.7", "--outer-momentum", "0.9"]),
    "int8-downlink": (["--down-codec", "int8", "--publish-to", "contributors"], ["--down-codec", "fp32"]),
    "publish-to-contributors": (["--publish-to", "contributors"], ["--publish-to", "live", "--down-codec", "fp32"]),
}
SETTINGS = {
    "equal": [],
    "hetero": ["--speeds", "1,1,0.5,0.25", "--chaos", "kill-one"],
}


def configurations(mechanisms: list[str], include: str) -> dict[str, list[str]]:
    """Name → extra flags: the paper preset, paper + each mechanism, the defaults, defaults − each mechanism.

    A mechanism written "a+b" is several mechanisms put on (or taken off) together.
    """
    def flags(combined: str, which: int) -> list[str]:
        return [f for m in combined.split("+") for f in MECHANISMS[m][which]]

    out = {}
    if include in ("all", "paper"):
        out["paper"] = ["--preset", "paper"]
        for m in mechanisms:
            out[f"paper + {m}"] = ["--preset", "paper", *flags(m, 0)]
    if include in ("all", "default"):
        out["default"] = []
        for m in mechanisms:
            out[f"default − {m}"] = flags(m, 1)
    return out


def run_once(flags: list[str], setting: str, seed: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "diloco", "run", "--mode", "decoupled", "--learners", "4", "--model", args.model,
           "--duration", str(args.duration), "--pace", str(args.pace), "--seed", str(seed), "--json",
           "--no-progress", "--snapshots", "2", "--out", str(out), *SETTINGS[setting], *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=die_with_parent())
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd[3:])}): {proc.stderr[-1500:]}")
    report = json.loads(proc.stdout)
    return {k: report[k] for k in ("final_eval_loss", "initial_eval_loss", "tokens_trained", "tokens_merged",
                                   "goodput", "wall_seconds", "pace_overruns", "wire_bytes")}


def tag(name: str) -> str:
    """A configuration's name as a folder name."""
    return name.replace(" ", "").replace("−", "-minus-").replace("+", "-plus-")


def summarise(runs: list[dict]) -> dict:
    losses = [r["final_eval_loss"] for r in runs]
    return {"loss_mean": statistics.fmean(losses), "loss_half_range": (max(losses) - min(losses)) / 2,
            "tokens_trained": statistics.fmean(r["tokens_trained"] for r in runs),
            "goodput": statistics.fmean(r["goodput"] for r in runs), "runs": len(runs),
            "wire_bytes": statistics.fmean(r.get("wire_bytes", 0) for r in runs)}


def markdown(results: dict) -> str:
    """The sweep as markdown tables: one per setting, each configuration against the paper preset and defaults."""
    out = []
    for setting, rows in results["settings"].items():
        ref = {k: rows[k]["loss_mean"] for k in ("paper", "default") if k in rows}
        out += [f"**{setting}** ({', '.join(SETTINGS[setting]) or 'equal speeds, no faults'}):", "",
                "| configuration | held-out loss (mean ± half range) | vs its reference | tokens trained | goodput | "
                "wire MB | steps over pace |", "|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            base = ref.get("paper" if name.startswith("paper") else "default")
            diff = "" if base is None or name in ref else f"{r['loss_mean'] - base:+.3f}"
            overruns = sum(x.get("pace_overruns") or 0 for x in r["per_seed"])
            wire = statistics.fmean(x.get("wire_bytes", 0) for x in r["per_seed"]) / 1e6
            out.append(f"| {name} | {r['loss_mean']:.3f} ± {r['loss_half_range']:.3f} | {diff} | "
                       f"{r['tokens_trained']:,.0f} | {r['goodput']:.3f} | {wire:,.1f} | {overruns} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("small", "tiny"), default="tiny")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of training per run")
    p.add_argument("--pace", type=float, help="seconds per step at speed 1 (default: measured once, as --pace auto)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--settings", default="equal,hetero", help=f"comma-separated: {', '.join(SETTINGS)}")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS),
                   help="comma-separated subset; a+b puts on (or takes off) several together")
    p.add_argument("--include", choices=("all", "paper", "default"), default="all",
                   help="which sweeps: paper + each, defaults − each, or both")
    p.add_argument("--out", type=Path, default=Path("runs") / f"ablate-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--json", type=Path, help="write the results here (also written as the sweep goes)")
    p.add_argument("--markdown", type=Path, metavar="JSON", help="only print the tables of a finished sweep's JSON")
    p.add_argument("--runs", type=Path, help="with --markdown: the sweep's run folders, to read wire bytes from")
    args = p.parse_args()
    if args.markdown:
        results = json.loads(args.markdown.read_text())
        if args.runs:  # sweeps from before wire bytes were kept: read them from each run's report
            for setting, rows in results["settings"].items():
                for name, r in rows.items():
                    for seed, run in zip(args.seeds.split(","), r["per_seed"]):
                        report = args.runs / f"{setting}-{tag(name)}-s{seed}" / "report.json"
                        if "wire_bytes" not in run and report.exists():
                            run["wire_bytes"] = json.loads(report.read_text())["wire_bytes"]
        print(markdown(results))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    mechanisms = args.mechanisms.split(",")
    unknown = [part for m in mechanisms for part in m.split("+") if part not in MECHANISMS]
    if unknown:
        p.error(f"unknown mechanism {unknown[0]!r}; choose from {', '.join(MECHANISMS)}")
    if args.pace is None:
        from diloco.run.local import TINY
        from diloco.run.pacing import auto_pace
        from diloco.train.train_config import TrainConfig

        train = TrainConfig(model=TINY) if args.model == "tiny" else TrainConfig()
        args.pace = auto_pace(train, 5)
    console = Console(stderr=True)
    configs = configurations(mechanisms, args.include)
    total = len(configs) * len(seeds) * len(args.settings.split(","))
    console.print(f"{total} runs of {args.duration:g} s, paced at {args.pace:.3f} s per step")
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "settings": {}}
    if args.json and args.json.exists():  # resume a sweep that stopped: its finished configurations stay
        results["settings"] = json.loads(args.json.read_text()).get("settings", {})
    done = 0
    for setting in args.settings.split(","):
        rows = results["settings"].setdefault(setting, {})
        for name, flags in configs.items():
            if name in rows:
                done += len(seeds)
                continue
            runs = []
            for seed in seeds:
                runs.append(run_once(flags, setting, seed, args, args.out / f"{setting}-{tag(name)}-s{seed}"))
                done += 1
                console.print(f"[{done}/{total}] {setting} · {name} · seed {seed}: loss "
                              f"{runs[-1]['final_eval_loss']:.4f}, goodput {runs[-1]['goodput']:.3f}")
            rows[name] = {**summarise(runs), "flags": flags, "per_seed": runs}
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(stamped(results, args), indent=1))
        table = Table(title=f"{setting}: held-out loss at equal allocated tokens ({len(seeds)} seeds)")
        for col in ("configuration", "loss (mean ± half range)", "tokens trained", "goodput"):
            table.add_column(col, justify="left" if col == "configuration" else "right")
        for name, r in rows.items():
            table.add_row(name, f"{r['loss_mean']:.4f} ± {r['loss_half_range']:.4f}", f"{r['tokens_trained']:,.0f}",
                          f"{r['goodput']:.3f}")
        Console().print(table)


if __name__ == "__main__":
    main()
