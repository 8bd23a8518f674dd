"""A syncer's /status as a table in the terminal: one row per learner, a title line for the syncer, a caption for
refusals. `diloco run` shows its own run with it, `diloco status` any syncer (status_command.py); it imports
nothing of diloco's, so either may import it."""

from __future__ import annotations

from rich.table import Table


def _num(x, fmt="{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return str(n)


def progress_table(status: dict, elapsed: float, budget: str) -> Table:
    """`status` has the syncer's /status shape: learners with step/loss/tokens_per_second/pushes/applied."""
    versions = status.get("versions") or []
    title = (f"[bold]diloco {status.get('mode', '')}[/bold]  {elapsed:5.0f}s  {budget}   "
             f"rounds {status.get('rounds', 0):,}   versions {min(versions, default=0)}–{max(versions, default=0)}   "
             f"tokens {status.get('tokens_trained', 0):,} trained / {status.get('tokens_merged', 0):,.0f} merged   "
             f"wire {human_bytes(status.get('wire_bytes'))}")
    table = Table(title=title, title_justify="left", expand=False)
    for name, justify in (("learner", "left"), ("state", "left"), ("speed", "right"), ("step", "right"),
                          ("loss", "right"), ("tokens/s", "right"), ("pushed", "right"), ("applied", "right")):
        table.add_column(name, justify=justify)
    for learner in status.get("learners", []):
        state = learner.get("state", "")
        color = {"live": "green", "absent": "yellow", "left": "dim", "done": "dim"}.get(state, "")
        table.add_row(
            learner["id"], f"[{color}]{state}[/{color}]" if color else state, _num(learner.get("speed"), "{:.2f}"),
            _num(learner.get("step")), _num(learner.get("loss"), "{:.3f}"),
            _num(learner.get("tokens_per_second")), _num(learner.get("pushes")), _num(learner.get("applied")),
        )
    refusals = status.get("refusals") or {}
    if refusals:
        table.caption = "refusals: " + ", ".join(f"{reason} {n:,}" for reason, n in sorted(refusals.items()))
        table.caption_justify = "left"
    return table
