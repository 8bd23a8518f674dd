"""Presenting goodput sweeps: terminal table, JSON rows and a plot against chips."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from diloco.sim.presets import PUBLISHED_GOODPUT
from diloco.sim.sweep import CellResult


def label(result: CellResult) -> str:
    c = result.cell
    return c.strategy if c.learners == 1 and c.strategy.startswith("dp") else f"{c.strategy}-{c.learners}"


def to_rows(results: list[CellResult], preset: str, days: float, seed: int,
            show_published: bool) -> list[dict]:
    rows = []
    for r in results:
        row = {"strategy": r.cell.strategy, "chips": r.cell.chips, "learners": r.cell.learners,
               "goodput": round(r.goodput, 5), "uptime": round(r.uptime, 5),
               "goodput_ci95": round(r.goodput_ci, 5), "uptime_ci95": round(r.uptime_ci, 5),
               "failures_per_run": round(r.failures, 1), "repeats": r.repeats, "days": days,
               "preset": preset, "seed": seed}
        published = PUBLISHED_GOODPUT.get((r.cell.strategy, r.cell.chips, r.cell.learners))
        if show_published and published is not None:
            row["published_goodput"] = published
        rows.append(row)
    return rows


def chips_text(chips: int) -> str:
    if chips >= 1_000_000:
        return f"{chips / 1e6:g}M"
    return f"{chips / 1e3:g}k" if chips >= 1000 else str(chips)


def render_table(results: list[CellResult], console: Console, *, title: str, show_published: bool) -> None:
    table = Table(title=title)
    table.add_column("strategy", no_wrap=True)
    table.add_column("chips", justify="right")
    table.add_column("goodput", justify="right")
    table.add_column("±95%", justify="right")
    table.add_column("uptime", justify="right")
    if show_published:
        table.add_column("published", justify="right")
        table.add_column("diff", justify="right")
    table.add_column("failures", justify="right")
    for r in results:
        cells = [label(r), chips_text(r.cell.chips), f"{100 * r.goodput:.1f}%", f"{100 * r.goodput_ci:.1f}",
                 f"{100 * r.uptime:.1f}%"]
        if show_published:
            published = PUBLISHED_GOODPUT.get((r.cell.strategy, r.cell.chips, r.cell.learners))
            cells += ["" if published is None else f"{100 * published:.0f}%",
                      "" if published is None else f"{100 * (r.goodput - published):+.1f}"]
        cells.append(f"{r.failures:,.0f}")
        table.add_row(*cells)
    console.print(table)


def plot(results: list[CellResult], path: str, *, title: str, show_published: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    series: dict[str, list[CellResult]] = {}
    for r in results:
        series.setdefault(label(r), []).append(r)
    for name, points in series.items():
        points.sort(key=lambda r: r.cell.chips)
        xs = [r.cell.chips for r in points]
        line, = ax.plot(xs, [100 * r.goodput for r in points], marker="o", label=name)
        ax.fill_between(xs, [100 * (r.goodput - r.goodput_ci) for r in points],
                        [100 * (r.goodput + r.goodput_ci) for r in points], color=line.get_color(), alpha=0.2)
        if show_published:
            cell = points[0].cell
            published = sorted((n, g) for (s, n, m), g in PUBLISHED_GOODPUT.items()
                               if s == cell.strategy and m == cell.learners)
            if published:
                ax.scatter([n for n, _ in published], [100 * g for _, g in published], marker="x", s=60,
                           color=line.get_color(), zorder=3)
    ax.set_xscale("log")
    ticks = sorted({r.cell.chips for r in results})
    ax.set_xticks(ticks, [chips_text(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 102)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title + ("  (x: published)" if show_published else ""))
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
