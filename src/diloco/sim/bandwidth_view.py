"""Presenting the bandwidth model: terminal tables, JSON rows and utilisation curves."""

from __future__ import annotations

import math

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from diloco.sim.bandwidth import Method, Workload, bits_per_sync, required_gbps, syncs_per_step, utilisation
from diloco.sim.from_run import Projection


def _gbps(x: float) -> str:
    if math.isinf(x):
        return "never"
    return f"{x:.3g}"


def to_rows(methods: list[Method], workloads: list[Workload], targets: list[float],
            links: list[float]) -> list[dict]:
    rows = []
    for w in workloads:
        for m in methods:
            rows.append({
                "method": m.kind, "parameters": w.parameters, "step_seconds": w.step_seconds,
                "datacenters": w.datacenters, "codec": m.codec, "fragments": m.fragments,
                "sync_every": m.sync_every, "overlap_steps": m.overlap_steps,
                "gbit_per_step": bits_per_sync(m, w) * syncs_per_step(m) / 1e9,
                "required_gbps": {f"{t:g}": _finite(required_gbps(m, w, t)) for t in targets},
                "utilisation": {f"{g:g}": utilisation(m, w, g) for g in links},
            })
    return rows


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def size_text(parameters: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{suffix}"
    return f"{parameters:.3g}"


def render_table(rows: list[dict], targets: list[float], links: list[float], console: Console) -> None:
    table = Table(title="Bandwidth per datacenter link (Gbps) and compute utilisation", box=box.SIMPLE_HEAD,
                  caption="sync: codec fragments/steps between syncs of a fragment/overlap steps")
    table.add_column("method", no_wrap=True)
    table.add_column("model", no_wrap=True)
    table.add_column("D", justify="right")
    table.add_column("sync", no_wrap=True)
    table.add_column("Gbit/step", justify="right")
    for t in targets:
        table.add_column(f"need {100 * t:g}%", justify="right")
    for g in links:
        table.add_column(f"@{g:g}G", justify="right")
    for r in rows:
        cells = [r["method"], f"{size_text(r['parameters'])} {r['step_seconds']:.3g}s", str(r["datacenters"]),
                 f"{r['codec']} {r['fragments']}/{r['sync_every']}/{r['overlap_steps']}",
                 f"{r['gbit_per_step']:.3g}"]
        cells += [_gbps(math.inf if v is None else v) for v in r["required_gbps"].values()]
        cells += [f"{100 * u:.0f}%" for u in r["utilisation"].values()]
        table.add_row(*cells)
    console.print(table)


def projection_row(p: Projection) -> dict:
    return {
        "mode": p.run.mode, "measured": {
            "parameters": p.run.parameters, "learners": p.run.learners, "step_seconds": p.run.step_seconds,
            "wire_bytes": p.run.wire_bytes, "steps": p.run.steps,
            "bits_per_learner_step": p.run.bits_per_learner_step,
            "bits_per_parameter_step": p.run.bits_per_learner_step / p.run.parameters},
        "overhead_vs_model": p.overhead,
        "projected": {
            "parameters": p.workload.parameters, "learners": p.workload.datacenters,
            "step_seconds": p.workload.step_seconds, "gbit_per_step": p.bits_per_step / 1e9,
            "link_gbps": p.gbps, "utilisation": p.utilisation, "target": p.target,
            "required_gbps": _finite(p.required_gbps)},
    }


def render_projection(p: Projection, console: Console) -> None:
    table = Table(title=f"Projection of a measured {p.run.mode} run")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("projected", justify="right")
    per_param = p.run.bits_per_learner_step / p.run.parameters
    table.add_row("parameters", size_text(p.run.parameters), size_text(p.workload.parameters))
    table.add_row("learners", str(p.run.learners), str(p.workload.datacenters))
    table.add_row("step time (s)", f"{p.run.step_seconds:.3g}", f"{p.workload.step_seconds:.3g}")
    table.add_row("wire Gbit per learner-step", f"{p.run.bits_per_learner_step / 1e9:.3g}",
                  f"{p.bits_per_step / 1e9:.3g}")
    table.add_row("wire bits per parameter-step", f"{per_param:.3g}",
                  f"{p.bits_per_step / p.workload.parameters:.3g}")
    table.add_row("measured / modelled volume", f"{p.overhead:.2f}", "")
    table.add_row(f"utilisation on {p.gbps:g} Gbps", "", f"{100 * p.utilisation:.1f}%")
    table.add_row(f"Gbps for {100 * p.target:g}%", "", _gbps(p.required_gbps))
    console.print(table)


def plot(methods: list[Method], work: Workload, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = np.logspace(-2, 3.5, 300)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for m in methods:
        ax.plot(links, [100 * utilisation(m, work, g) for g in links], label=f"{m.kind} ({m.codec})")
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth per datacenter (Gbps)")
    ax.set_ylabel("compute utilisation (%)")
    ax.set_ylim(0, 102)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{size_text(work.parameters)} parameters, {work.step_seconds:g} s per step, "
                 f"{work.datacenters} datacenters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
