"""Time to target over shaped links: every mode on the same model, data and seed, each learner (dp: each worker)
behind its own link shaped to each rate (`diloco run --link RATE`, docs/architecture.md "Shaped links").

    python -m benchmarks.links.wan --model tiny --rates none,100mbit,20mbit,5mbit,2mbit \\
        --modes dp,diloco,streaming,decoupled --tokens 1600000 --json runs/wan-tiny.json
    python -m benchmarks.links.wan --markdown runs/wan-tiny.json          # the tables of a finished sweep
    python -m benchmarks.links.wan --plot runs/wan-tiny.json runs/wan-tiny.png

Definitions (printed under every table):
- T, the target: dp's final held-out loss on unshaped links after its budget × (1 + --margin), or --target.
- Time to T: seconds from the first step of any learner (start-up and the first join excluded) until the global
  model's held-out loss first reaches T, interpolated linearly between its eval points (--snapshots of them).
- dp's time to T is computed, not read off a clock: (the step at which its unshaped trajectory first reaches T) ×
  (its median seconds per step measured on that link). Its loss per step does not depend on the link (same data,
  same seed, deterministic all-reduce), so on a link it may run only --dp-link-steps steps to measure its step time.
- S = dp's seconds per step on the link ÷ unshaped: how much the link slows dp, and the most any mode could gain.
  Speed-up = dp's time to T ÷ the mode's; speed-up / S is the share of that limit reached.
- Utilisation: Σ over learners of the seconds spent in inner steps ('busy' in metrics/*.jsonl) ÷ (learners ×
  the training window), so waiting for the network counts as idle.
- Wire bytes: report.json's wire_bytes (gRPC messages learner ↔ syncer; dp: the ring all-reduce formula). Link bytes:
  what the shaped links carried (kernel counters, with headers); dp's are halved, since each of its bytes crosses
  the sender's link and the receiver's.
- Budget: every mode gets the same --tokens (the learning-rate schedule is tied to it). With --budgets the modes
  other than dp try each budget, smallest first, and the table reports the smallest whose run reaches T.
- --speeds and --chaos go to every mode. Faults need a time budget (--duration), under which dp's trajectory
  depends on the link: its time to T is then read off its own eval curve, like every other mode's.
  E.g. `--rates none,20mbit,5mbit --speeds 1,1,1,0.5`, or `--duration 40 --chaos kill-one` (T then comes from dp
  under the same faults; --target sets it from a clean sweep instead).
- dp on slow links is slow to run in full (the default model moves ~5 MB per worker per step: ~20 s a step at
  2mbit); --dp-link-steps 30 measures its step time in 30 steps instead.

Each run is one `diloco run --json`; the sweep is written to --json after every run and resumes from it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped

COLUMNS = ("link", "mode", "budget", "s/step", "S", "time to T", "speed-up", "speed-up / S", "tokens to T",
           "utilisation", "wire MB", "link MB", "final loss")


# ---- pure parts: eval curves, step times, the comparison ----

def first_reach(curve: list[dict], target: float) -> dict | None:
    """Seconds and tokens (and wire bytes, where both points have them) at which the loss first reaches `target`
    (≤), interpolated linearly between the two eval points around the crossing; None when it never does. Points:
    {"seconds", "tokens", "loss"} and perhaps "wire_bytes" (the syncer's count at that snapshot)."""
    for i, p in enumerate(curve):
        if p["loss"] <= target:
            keys = [k for k in ("seconds", "tokens", "wire_bytes") if p.get(k) is not None
                    and (i == 0 or curve[i - 1].get(k) is not None)]
            if i == 0 or p["loss"] == target:
                return {k: p[k] for k in keys}
            q = curve[i - 1]
            f = (q["loss"] - target) / (q["loss"] - p["loss"])
            return {k: q[k] + f * (p[k] - q[k]) for k in keys}
    return None


def step_seconds(metrics: dict[str, list[dict]]) -> float:
    """Median seconds between consecutive steps of one worker (one attempt: a restart starts a new series)."""
    gaps = [b["t"] - a["t"] for lines in metrics.values() for a, b in zip(lines, lines[1:])
            if a.get("restarts", 0) == b.get("restarts", 0)]
    return statistics.median(gaps) if gaps else float("nan")


def window(metrics: dict[str, list[dict]]) -> tuple[float, float]:
    """(unix time the first step of any learner began, unix time the last step ended)."""
    lines = [x for ls in metrics.values() for x in ls]
    return min(x["t"] - x["busy"] for x in lines), max(x["t"] for x in lines)


def utilisation(metrics: dict[str, list[dict]], learners: int) -> float:
    """Share of the training window the learners spent in inner steps."""
    start, end = window(metrics)
    busy = sum(x["busy"] for ls in metrics.values() for x in ls)
    return busy / (learners * (end - start)) if end > start else float("nan")


def slowdown(dp_link_step: float, dp_unshaped_step: float) -> float:
    """S: how many times longer a dp step takes on the link than unshaped."""
    return dp_link_step / dp_unshaped_step


def dp_time_to_target(step_at_target: float, seconds_per_step: float) -> float:
    """dp's time to T from its trajectory: the (interpolated) step reaching T × its seconds per step on the link."""
    return step_at_target * seconds_per_step


def speed_up(dp_time: float | None, mode_time: float | None) -> float | None:
    return None if dp_time is None or not mode_time else dp_time / mode_time


# ---- runs ----

def budget_label(budget: float, kind: str) -> str:
    return f"{budget:g}s" if kind == "duration" else f"{int(budget)}"


def budget_text(label: str) -> str:
    """"300000" → "300,000 tokens"; "40s" stays."""
    return f"{int(label):,} tokens" if label.isdigit() else label


def run_key(mode: str, rate: str, label: str) -> str:
    return f"{mode}@{rate}@{label}"


def summarise(out: Path, report: dict) -> dict:
    """What the comparison needs from one finished run directory and its report."""
    from diloco.run.report import read_metrics

    metrics = read_metrics(out / "metrics")
    start, end = window(metrics)
    origin = json.loads((out / ("dp/dp.json" if report["mode"] == "dp" else "syncer/syncer.json")).read_text())
    shift = origin["started_unix"] - start  # the curve's seconds count from the syncer's (dp: job's) start
    curve = [{"seconds": max(0.0, p["seconds"] + shift) if i else 0.0, "tokens": p["tokens_trained"],
              "loss": p["eval_loss"], "wire_bytes": p.get("wire_bytes")} for i, p in enumerate(report["eval_curve"])]
    train = report["train"]
    link = report.get("link_bytes_total")
    return {"mode": report["mode"], "learners": report["learners"], "curve": curve,
            "final_loss": report["final_eval_loss"], "tokens_trained": report["tokens_trained"],
            "step_seconds": step_seconds(metrics), "utilisation": utilisation(metrics, report["learners"]),
            "wire_bytes": report["wire_bytes"], "wire_parts": report.get("wire_parts", {}),
            "window_seconds": end - start,
            "link_bytes": None if link is None else link / 2 if report["mode"] == "dp" else link,
            "tokens_per_step": train["batch_size"] * train["model"]["seq_len"] * report["learners"],
            "steps": max((x["step"] for ls in metrics.values() for x in ls), default=0), "out": str(out)}


def run_once(mode: str, rate: str, budget: list[str], args, extra: list[str], out: Path) -> dict:
    """One `diloco run` in a fresh folder under `out` (a failed attempt's folder is left for its logs)."""
    attempt, folder = 0, out
    while folder.exists():
        attempt += 1
        folder = out.with_name(f"{out.name}.{attempt}")
    cmd = [sys.executable, "-m", "diloco", "run", "--mode", mode, "--model", args.model, "--learners",
           str(args.learners), "--seed", str(args.seed), "--snapshots", str(args.snapshots), *budget, "--json",
           "--no-progress", "--out", str(folder)]
    cmd += [] if rate == "none" else ["--link", rate]
    cmd += ["--speeds", args.speeds] if args.speeds else []
    cmd += ["--chaos", args.chaos] if args.chaos else []
    cmd += ["--pace", str(args.pace)] if args.pace else []
    proc = subprocess.run(cmd + extra, capture_output=True, text=True, preexec_fn=die_with_parent())
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd[3:] + extra)}): {proc.stderr[-1500:]}")
    return {**summarise(folder, json.loads(proc.stdout)), "projected": projected(folder, rate)}


def projected(folder: Path, rate: str) -> dict | None:
    """What `diloco simulate bandwidth --from-run FOLDER --gbps RATE` predicts for the run on its own link: the
    bandwidth model calibrated on the run's wire bytes per step and its median compute step (unshaped: no limit)."""
    from diloco.run.links import parse_link
    from diloco.sim.bandwidth import step_time
    from diloco.sim.from_run import ReportError, load_run, project

    bps = parse_link(rate)
    try:
        p = project(load_run(folder), gbps=(bps or 1e15) / 1e9)
    except (ReportError, ValueError):
        return None
    return {"utilisation": p.utilisation, "overhead": p.overhead, "compute_seconds": p.workload.step_seconds,
            "step_seconds": step_time(p.method, p.workload, p.gbps)}


# ---- the comparison ----

def target(results: dict) -> float:
    """T: --target, or dp's final unshaped loss × (1 + margin)."""
    if results.get("target") is not None:
        return results["target"]
    dp = results["runs"].get(run_key("dp", "none", results["budget_label"]))
    if dp is None:
        raise ValueError("no target: run dp on unshaped links (--modes dp,… --rates none,…) or give --target")
    return dp["final_loss"] * (1 + results["margin"])


def best_run(results: dict, mode: str, rate: str, t: float) -> dict | None:
    """The run a row reports: the smallest budget that reached T, else the largest tried."""
    runs = sorted((r for k, r in results["runs"].items() if k.startswith(f"{mode}@{rate}@")),
                  key=lambda r: r["budget"])
    return next((r for r in runs if first_reach(r["curve"], t)), runs[-1] if runs else None)


def analyse(results: dict) -> list[dict]:
    """One row per (rate, mode) that ran: S, time and tokens to T, speed-up against dp, utilisation, bytes."""
    t, rows = target(results), []
    dp0 = results["runs"].get(run_key("dp", "none", results["budget_label"]))
    dp0_reach = first_reach(dp0["curve"], t) if dp0 else None
    computed = results["kind"] == "tokens" and not results.get("chaos")
    for rate in results["rates"]:
        dp = best_run(results, "dp", rate, t)
        s = slowdown(dp["step_seconds"], dp0["step_seconds"]) if dp and dp0 else None
        dp_time = None
        if dp and computed and dp0_reach:
            dp_time = dp_time_to_target(dp0_reach["tokens"] / dp0["tokens_per_step"], dp["step_seconds"])
        elif dp and not computed:
            dp_time = (first_reach(dp["curve"], t) or {}).get("seconds")
        for mode in results["modes"]:
            r = best_run(results, mode, rate, t)
            if r is None:
                continue
            reach = first_reach(r["curve"], t)
            row = {"rate": rate, "mode": mode, "budget": r["label"], "step_seconds": r["step_seconds"], "S": s,
                   "time_to_T": reach and reach["seconds"], "tokens_to_T": reach and reach["tokens"],
                   "utilisation": r["utilisation"], "wire_bytes": r["wire_bytes"], "link_bytes": r["link_bytes"],
                   "final_loss": r["final_loss"], "scaled": False}
            if mode == "dp":
                if computed:  # the time read off its own curve, beside the computed one
                    row["time_to_T_curve"] = row["time_to_T"]
                row["time_to_T"] = dp_time
                if r["label"].endswith("steps") and dp0:  # a probe of its step time: bytes as over the full budget
                    scale = dp0["steps"] / r["steps"]
                    row.update(budget=f"{r['steps']} steps", scaled=True, final_loss=None,
                               wire_bytes=r["wire_bytes"] * scale,
                               link_bytes=r["link_bytes"] and r["link_bytes"] * scale)
                if computed and dp0_reach:
                    row["tokens_to_T"] = dp0_reach["tokens"]
            row["speed_up"] = speed_up(dp_time, row["time_to_T"])
            row["share"] = row["speed_up"] / s if row["speed_up"] and s else None
            rows.append(row)
    return rows


def cells(row: dict) -> list[str]:
    def num(x, fmt, unit=""):
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{fmt}}{unit}"

    time_to_t = "not reached" if row["time_to_T"] is None else f"{row['time_to_T']:.1f} s"
    if row["mode"] == "dp" and row.get("time_to_T_curve") is not None and row["time_to_T"] is not None:
        time_to_t += f" (clock {row['time_to_T_curve']:.1f} s)"
    mb = "{:,.1f}*" if row["scaled"] else "{:,.1f}"
    budget = f"{int(row['budget']):,}" if row["budget"].isdigit() else row["budget"]
    return ["unshaped" if row["rate"] == "none" else row["rate"], row["mode"], budget,
            num(row["step_seconds"], ".3f"), num(row["S"], ".1f", "×"), time_to_t, num(row["speed_up"], ".2f", "×"),
            num(row["share"], ".2f"), num(row["tokens_to_T"], ",.0f"), num(row["utilisation"], ".2f"),
            mb.format(row["wire_bytes"] / 1e6),
            "–" if row["link_bytes"] is None else mb.format(row["link_bytes"] / 1e6), num(row["final_loss"], ".4f")]


def notes(results: dict, rows: list[dict]) -> list[str]:
    t = target(results)
    basis = (f"--target {t:.4f}" if results.get("target") is not None else
             f"dp's final unshaped loss × {1 + results['margin']:g} = {t:.4f}")
    budget = (f"every mode {budget_text(results['budget_label'])}" if not results.get("budgets") else
              f"dp {budget_text(results['budget_label'])}; other modes the smallest of "
              f"{', '.join(budget_text(b) for b in results['budgets'])} whose run "
              f"reaches T (the largest when none does)")
    dp_time = ("dp's time to T = (step at which its unshaped trajectory reaches T) × (its median s/step on the link); "
               "'clock' is the time read off its own eval curve on that link"
               if results["kind"] == "tokens" and not results.get("chaos") else
               "dp's time to T is read off its own eval curve on each link (a time budget or faults change its "
               "trajectory)")
    return [f"T = {basis}. Budget: {budget}; model {results['model']}, {results['learners']} learners, seed "
            f"{results['seed']}" + (f", speeds {results['speeds']}" if results.get("speeds") else "") +
            (f", chaos {results['chaos']}" if results.get("chaos") else "") +
            (f", every step paced to {results['pace']:.3f} s at speed 1" if results.get("pace") else "") + ".",
            f"{dp_time}. S = dp's s/step on the link ÷ unshaped; speed-up = dp's time to T ÷ the mode's.",
            "Utilisation = Σ busy step seconds ÷ (learners × training window). dp's link MB are halved (each byte "
            "crosses two links)." + (" * dp ran only a probe of its step time on that link: its bytes are scaled "
                                     "to the full budget; see the unshaped row for its loss."
                                     if any(r["scaled"] for r in rows) else "")]


def projection_markdown(results: dict) -> str:
    """Measured utilisation (and dp's seconds per step) on each link beside what the bandwidth model predicts from
    each run's own report (`projected`)."""
    lines = ["| link | mode | compute s/step | s/step measured | s/step predicted | utilisation measured | "
             "utilisation predicted | measured ÷ modelled bytes |", "|---|---|---|---|---|---|---|---|"]
    for key, r in results["runs"].items():
        mode, rate, _ = key.split("@")
        p = r.get("projected")
        if p is None:
            continue
        lines.append(f"| {'unshaped' if rate == 'none' else rate} | {mode} | {p['compute_seconds']:.3f} | "
                     f"{r['step_seconds']:.3f} | {p['step_seconds']:.3f} | {r['utilisation']:.2f} | "
                     f"{p['utilisation']:.2f} | {p['overhead']:.2f} |")
    return "\n".join(lines) + "\n"


def markdown(results: dict) -> str:
    rows = analyse(results)
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(out + [""] + notes(results, rows)) + "\n"


def print_table(results: dict) -> None:
    table = Table(title=f"time to target over shaped links (T = {target(results):.4f})", title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("link", "mode") else "right")
    rows = analyse(results)
    for row in rows:
        table.add_row(*cells(row))
    console = Console(width=200)
    console.print(table)
    for line in notes(results, rows):
        console.print(line)


def plot(results: dict, path: Path) -> None:
    """Time to T per mode against the link rate (log axes; unshaped drawn right of the fastest rate), with the
    physical limit dp's time / S, which is dp's unshaped time to T. Rows that never reach T are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from diloco.run.links import parse_link

    rows = analyse(results)
    shaped = [parse_link(r) / 1e6 for r in results["rates"] if r != "none"]
    x_of = {r: (parse_link(r) / 1e6 if r != "none" else 4 * max(shaped or [100])) for r in results["rates"]}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in results["modes"]:
        pts = sorted((x_of[r["rate"]], r["time_to_T"]) for r in rows if r["mode"] == mode and r["time_to_T"])
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode)
    limit = next((r["time_to_T"] for r in rows if r["mode"] == "dp" and r["rate"] == "none"), None)
    if limit:
        ax.axhline(limit, color="grey", linestyle="--", label="limit: dp's time / S (dp unshaped)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(x_of.values()), ["unshaped" if r == "none" else r for r in x_of], rotation=30)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("link per learner (each way)")
    ax.set_ylabel(f"seconds to held-out loss {target(results):.3f}")
    ax.set_title(f"time to target, model {results['model']}, {results['learners']} learners")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the sweep ----

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("small", "tiny"), default="tiny")
    p.add_argument("--modes", default="dp,diloco,streaming,decoupled", help="comma-separated; dp sets T and S")
    p.add_argument("--rates", default="none,100mbit,20mbit,5mbit,2mbit", help="link rates per learner; none: unshaped")
    p.add_argument("--tokens", type=int, help="token budget of every run (default 1,600,000)")
    p.add_argument("--duration", type=float, help="seconds of training per run instead (needed with --chaos)")
    p.add_argument("--budgets", help="comma-separated budgets (of --tokens' or --duration's kind) for the modes other "
                                     "than dp: the smallest whose run reaches T is reported")
    p.add_argument("--dp-link-steps", type=int, default=0,
                   help="on shaped links run dp only this many steps, to measure its step time (0: its full budget)")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshots", type=int, default=20, help="eval points per run (time to T is interpolated)")
    p.add_argument("--margin", type=float, default=0.05, help="T = dp's final loss × (1 + margin)")
    p.add_argument("--target", type=float, help="T as a held-out loss, instead of dp's")
    p.add_argument("--speeds", help="per-learner speed factors for every mode, e.g. 1,1,1,0.5")
    p.add_argument("--chaos", help="the same fault scenario for every mode (needs --duration)")
    p.add_argument("--pace", type=float, help="seconds per step at speed 1 for every run (default with --chaos: "
                                              "measured once)")
    p.add_argument("--out", type=Path, default=Path("runs") / f"wan-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--json", type=Path, help="write the sweep here after every run; an existing one is resumed")
    p.add_argument("--markdown", type=Path, metavar="JSON", help="only print the tables of a finished sweep")
    p.add_argument("--plot", nargs=2, type=Path, metavar=("JSON", "PNG"), help="only plot a finished sweep")
    p.add_argument("--projection", type=Path, metavar="JSON",
                   help="only print measured utilisation beside the bandwidth model's prediction for each run")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to every `diloco run` (after --)")
    args = p.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return 0
    if args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
        return 0
    if args.projection:
        print(projection_markdown(json.loads(args.projection.read_text())), end="")
        return 0
    if args.tokens and args.duration:
        p.error("give --tokens or --duration, not both")
    if args.chaos and not args.duration:
        p.error("--chaos needs --duration: killed learners restart, so a token budget has no fixed length")
    kind = "duration" if args.duration else "tokens"
    main_budget = args.duration or args.tokens or 1_600_000
    budgets = sorted({float(b) for b in args.budgets.split(",")}) if args.budgets else [float(main_budget)]
    modes, rates = args.modes.split(","), args.rates.split(",")
    if args.target is None and ("dp" not in modes or "none" not in rates):
        p.error("T comes from dp on unshaped links: include dp in --modes and none in --rates, or give --target")
    results = {"model": args.model, "modes": modes, "rates": rates, "kind": kind, "learners": args.learners,
               "seed": args.seed, "margin": args.margin, "target": args.target, "speeds": args.speeds,
               "chaos": args.chaos, "budget_label": budget_label(main_budget, kind),
               "budgets": [budget_label(b, kind) for b in budgets] if args.budgets else None, "runs": {}}
    if args.json and args.json.exists():
        old = json.loads(args.json.read_text())
        results["runs"], args.pace = old.get("runs", {}), args.pace or old.get("pace")
    if args.chaos and args.pace is None:  # one pace for every run, as `diloco compare` does
        from diloco.run.local import TINY
        from diloco.run.pacing import auto_pace
        from diloco.train.train_config import TrainConfig

        args.pace = auto_pace(TrainConfig(model=TINY) if args.model == "tiny" else TrainConfig(), args.learners + 1)
    results["pace"] = args.pace
    extra = [a for a in args.extra if a != "--"]
    console = Console(stderr=True)

    def ensure(mode: str, rate: str, budget: float, steps: int | None = None) -> dict:
        label = f"{steps}steps" if steps else budget_label(budget, kind)
        key = run_key(mode, rate, label)
        if key not in results["runs"]:
            flags = ["--steps", str(steps)] if steps else [f"--{kind}", f"{budget:g}" if kind == "duration" else
                                                          str(int(budget))]
            started = time.monotonic()
            r = run_once(mode, rate, flags, args, extra, args.out / f"{mode}-{rate}-{label}")
            results["runs"][key] = {**r, "label": label, "budget": steps or budget}
            console.print(f"{key}: final loss {r['final_loss']:.4f}, {r['step_seconds']:.3f} s/step, "
                          f"{time.monotonic() - started:.0f} s")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(stamped(results, args), indent=1))
        return results["runs"][key]

    if "dp" in modes and "none" in rates:
        ensure("dp", "none", main_budget)
    t = target(results)
    console.print(f"T = {t:.4f}")
    for rate in rates:
        for mode in modes:
            if mode == "dp":
                probe = args.dp_link_steps if rate != "none" and kind == "tokens" else 0
                ensure("dp", rate, main_budget, probe or None)
                continue
            for budget in budgets:
                if first_reach(ensure(mode, rate, budget)["curve"], t):
                    break
    print_table(results)
    print(projection_markdown(results), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
