"""The end of a run: evaluate the global model's snapshots, account goodput and uptime, write the run directory."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from diloco.run import accounting, live_eval
from diloco.run.live_eval import load_params
from diloco.status_view import human_bytes
from diloco.train.data import Corpus, eval_batches, evaluate, sample_text
from diloco.train.model import build_model, count_parameters
from diloco.train.tokenizer import ByteTokenizer


def read_metrics(folder: Path) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(folder.glob("*.jsonl")):
        lines = []
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
        out[path.stem] = lines
    return out


def build_report(plan, learners: list[dict], source: dict, started_unix: float) -> dict:
    torch.set_num_threads(2)
    out, train = plan.out, plan.train
    metrics = read_metrics(out / "metrics")
    lines = [x for ls in metrics.values() for x in ls]
    t0 = min((x["t"] for x in lines), default=started_unix)
    t1 = max((x["t"] for x in lines), default=started_unix)
    wall = t1 - t0
    tokens_per_step = train.tokens_per_step() * plan.ranks_per_learner  # a learner's ranks each take a batch
    faults = source.get("faults", plan.fault_timeline or [])
    origin = plan.fault_origin_unix or t0
    windows = accounting.fault_windows(faults, origin)
    for summary in learners:
        ls = metrics.get(summary["id"], [])
        summary.setdefault("steps", len(ls))
        summary["healthy_tokens_per_second"] = accounting.healthy_rate(ls, windows, tokens_per_step)
    rates = {s["id"]: s["healthy_tokens_per_second"] for s in learners}
    if plan.pace:  # the capacity each learner was allocated: fixed before the run, whatever its neighbours do
        speeds = dict(zip([f"learner-{i}" for i in range(plan.learners)], plan.speeds))
        rates = {lid: accounting.paced_rate(tokens_per_step, speeds.get(lid, 1.0), plan.pace) for lid in rates}
        for summary in learners:
            summary["allocated_tokens_per_second"] = rates[summary["id"]]
    for summary in learners:  # a restarted learner's summary covers only its last life; its metrics cover all
        lives = accounting.tokens_per_life(metrics.get(summary["id"], []))
        if len(lives) > 1 and plan.mode != "dp":
            summary["tokens"], summary["lives"] = sum(lives), len(lives)
    tokens_trained = sum(s.get("tokens", 0) for s in learners)
    step_median = statistics.median([x["busy"] for x in lines]) if lines else float("nan")

    if plan.mode == "dp":
        tokens_merged, rounds, wire = tokens_trained, source["steps"], source["wire_bytes"]
        advances = accounting.new_steps(metrics.get("learner-0", []))
        interval = 2 * step_median
        model_dir, config = out / "dp", {"fragments": 1, "sync_every": 1, "overlap": 0, "codec": "fp32"}
    else:
        cfg = json.loads((out / "sync_config.json").read_text())
        tokens_merged, rounds, wire = source["tokens_merged"], source["rounds"], source["wire_bytes"]
        advances = [source["started_unix"] + t for t, *_ in source.get("round_log", [])]
        fastest = min((s["busy_seconds_median"] for s in learners if s.get("busy_seconds_median")), default=step_median)
        interval = accounting.advance_interval(cfg, fastest)
        model_dir, config = out / "syncer", cfg

    model = build_model(train.model, train.seed)
    corpus = Corpus.from_config(train)
    batches = eval_batches(corpus.heldout, train.model.seq_len, train.eval_batches, train.eval_batch_size)
    curve = [{"seconds": 0.0, "tokens_trained": 0, "tokens_merged": 0, "eval_loss": evaluate(model, batches)}]
    known = live_eval.cached(out)  # snapshots already evaluated during the run
    for path in sorted((model_dir / "snapshots").glob("*.safetensors")):
        meta = load_params(model, path)
        loss = known[path.name] if path.name in known else evaluate(model, batches)
        point = {"seconds": float(meta.get("seconds", 0)), "tokens_trained": int(float(meta.get("tokens_trained", 0))),
                 "tokens_merged": float(meta.get("tokens_merged", 0)), "eval_loss": loss}
        if "wire_bytes" in meta:  # the syncer's count when the snapshot was taken: bytes to a given quality
            point["wire_bytes"] = int(float(meta["wire_bytes"]))
        curve.append(point)
    final_path = model_dir / "model.safetensors"
    load_params(model, final_path)
    final_loss = evaluate(model, batches)
    shutil.copyfile(final_path, out / "model.safetensors")
    sample = sample_text(model, ByteTokenizer(), prompt="**ROMEO**  \n", max_new_tokens=300, seed=train.seed)
    (out / "sample.txt").write_text(sample + "\n")

    report = {
        "mode": plan.mode,
        "learners": plan.learners,
        "speeds": plan.speeds,
        "wall_seconds": round(wall, 3),
        "tokens_trained": tokens_trained,
        "tokens_merged": round(tokens_merged),
        "initial_eval_loss": curve[0]["eval_loss"],
        "final_eval_loss": final_loss,
        "eval_loss_reduction": 1 - final_loss / curve[0]["eval_loss"],
        "wire_bytes": int(wire),
        "wire_parts": source.get("wire_parts", {}),
        "rounds": rounds,
        "goodput": accounting.goodput(tokens_merged, rates, wall),
        "goodput_basis": (f"merged tokens / (Σ allocated tokens/s × wall-clock); allocated = tokens per step × "
                          f"speed / pace, paced at {plan.pace:.3f} s per step at speed 1" if plan.pace else
                          "merged tokens / (Σ healthy tokens/s × wall-clock); healthy = measured in fault-free time "
                          "(unpaced: may exceed 1 when a neighbour's death frees cores)"),
        "pace": plan.pace,
        "pace_overruns": sum(s.get("pace_overruns") or 0 for s in learners),
        "uptime": accounting.uptime(advances, t0, t1, interval),
        **link_fields(plan, source),
        "model_parameters": count_parameters(model),
        "step_seconds_median": step_median,
        "config": config,
        "train": json.loads((out / "train_config.json").read_text()),
        "per_learner": learners,
        "eval_curve": curve,
        "sample": sample,
    }
    report["warnings"] = run_warnings(plan, report)
    if plan.chaos:
        report["chaos"] = {"scenario": plan.chaos, "faults": faults}
        if plan.mode == "dp":
            report["chaos"].update(restarts=source.get("restarts", []), lost_steps=source.get("lost_steps", 0))
        run_start = source.get("started_unix", t0)
        plot_timeline([t - run_start for t in advances], faults, origin - run_start,
                      plan.mode, out / "timeline.png")
    if getattr(plan, "tensorboard", None):
        write_tensorboard(curve, plan.tensorboard / "global")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot_curve(curve, plan.mode, out / "eval_loss.png")
    return report


def link_fields(plan, source: dict) -> dict:
    """The shaped links (`--link`, `--link-latency-ms`) and what crossed them: per learner the bytes its link
    carried up (from it) and down (to it), counted by the kernel on the link's host end with Ethernet headers; in dp
    a byte between two workers crosses both of their links, so it counts in each one's up or down."""
    from diloco.run.links import link_text

    fields = {"link": link_text(plan)}
    if getattr(plan, "link", None):
        fields["link_bits_per_second"] = plan.link
    if getattr(plan, "link_latency_ms", 0):
        fields["link_latency_ms"] = plan.link_latency_ms
    per_link = source.get("link_bytes")
    if per_link is not None:
        fields["link_bytes"] = per_link
        fields["link_bytes_total"] = sum(x["up"] + x["down"] for x in per_link.values())
    return fields


def write_tensorboard(curve: list[dict], log_dir: Path) -> None:
    """The global model's held-out loss against tokens trained and merged, as TensorBoard scalars."""
    from diloco.train.loop import tensorboard_writer

    board = tensorboard_writer(log_dir)
    for point in curve:
        board.add_scalar("global/eval_loss_by_tokens_trained", point["eval_loss"], global_step=point["tokens_trained"])
        board.add_scalar("global/eval_loss_by_tokens_merged", point["eval_loss"], global_step=int(point["tokens_merged"]))
    board.close()


def plot_timeline(advances: list[float], faults: list[dict], offset: float, mode: str, path: Path) -> None:
    """Rounds closed over time (the global model advancing) with every injected fault shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(sorted(advances), range(1, len(advances) + 1), color="black", label="rounds closed")
    colors = {"kill": "tab:red", "hang": "tab:orange", "slow": "tab:olive", "syncer-crash": "tab:purple",
              "partition": "tab:blue"}
    for i, f in enumerate(faults):
        ax.axvspan(f["start"] + offset, f["end"] + offset, alpha=0.2, color=colors.get(f["kind"], "grey"))
        ax.text(f["start"] + offset, (i % 4 + 1) * max(len(advances), 1) / 5, f"{f['kind']} {f['target']}", fontsize=8)
    ax.set_xlabel("seconds since the syncer started")
    ax.set_ylabel("rounds closed (cumulative)")
    ax.set_title(f"global model progress under faults, mode {mode}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curve(curve: list[dict], mode: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    a.plot([c["tokens_trained"] for c in curve], [c["eval_loss"] for c in curve], marker="o")
    a.set_xlabel("tokens trained (all learners)")
    a.set_ylabel("held-out loss (nats/byte)")
    b.plot([c["seconds"] for c in curve], [c["eval_loss"] for c in curve], marker="o")
    b.set_xlabel("wall-clock (s)")
    fig.suptitle(f"global model, mode {mode}")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


SKIPPED_WARNING = 0.25
"""Share of due pushes skipped above which a run is told that its H is shorter than a round trip."""
OVERSHOOT_WARNING = 1.1
"""Tokens trained over the --tokens budget above which a run is told it overshot."""


def run_warnings(plan, report: dict) -> list[str]:
    """What a run's figures say the user should know: pushes skipped because their fragment's last result had not
    come back within H steps (each fragment then syncs less often than --sync-every says, and contributions longer
    than max_counter_ratio × H steps count for fewer tokens, so a --tokens budget overshoots)."""
    out = []
    pushes = sum(s.get("pushes") or 0 for s in report["per_learner"])
    skipped = sum(s.get("skipped") or 0 for s in report["per_learner"])
    if skipped and skipped / (pushes + skipped) > SKIPPED_WARNING:
        H = (report.get("config") or {}).get("sync_every")
        out.append(f"{100 * skipped / (pushes + skipped):.0f}% of due pushes were skipped: a fragment's last result had "
                   f"not come back within H = {H} steps, so fragments synced less often than --sync-every says; "
                   f"raise --sync-every")
    if plan.tokens and report["tokens_trained"] > OVERSHOOT_WARNING * plan.tokens:
        out.append(f"the learners trained {report['tokens_trained'] / plan.tokens:.2f}× the --tokens budget: the syncer "
                   f"counted fewer tokens than they trained (long contributions are bounded)")
    return out


def print_summary(report: dict, console: Console) -> None:
    t = Table(title=f"diloco run · {report['mode']} · {report['learners']} learners", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("wall-clock", f"{report['wall_seconds']:.1f} s"),
        ("tokens trained / merged", f"{report['tokens_trained']:,} / {report['tokens_merged']:,}"),
        ("eval loss initial → final", f"{report['initial_eval_loss']:.3f} → {report['final_eval_loss']:.3f} "
                                      f"(−{100 * report['eval_loss_reduction']:.1f}%)"),
        ("rounds", f"{report['rounds']:,}"),
        ("wire bytes", human_bytes(report["wire_bytes"])),
        ("goodput", f"{report['goodput']:.3f}" + (" (paced)" if report.get("pace") else " (unpaced)")),
        ("uptime", f"{report['uptime']:.3f}"),
    ]
    if report.get("link"):
        crossed = f"; {human_bytes(report['link_bytes_total'])} crossed them" if "link_bytes_total" in report else ""
        rows.append(("links", report["link"] + crossed))
    if report.get("pace"):
        steps = sum(s.get("steps", 0) for s in report["per_learner"]) or 1
        rows.append(("steps over their pace", f"{report['pace_overruns']:,} ({100 * report['pace_overruns'] / steps:.1f}%)"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    lt = Table(title="learners", title_justify="left")
    for col in ("id", "speed", "steps", "tokens", "pushes", "skipped", "applied", "tokens/s", "exit"):
        lt.add_column(col, justify="left" if col == "id" else "right")
    for s in report["per_learner"]:
        lt.add_row(s["id"], f"{s.get('speed', 1):.2f}", f"{s.get('steps', 0):,}", f"{s.get('tokens', 0):,}",
                   str(s.get("pushes", "–")), str(s.get("skipped", "–")), str(s.get("applied", "–")),
                   f"{s.get('healthy_tokens_per_second', 0):,.0f}",
                   str(s.get("exit_code", "")))
    console.print(lt)
    for warning in report.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {warning}")
    console.print(f"sample: {report['sample'][:160]!r}…")
