"""Generates docs/config.md from the configuration dataclasses' field docstrings: `python -m diloco.config_doc`."""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from diloco.config import SyncConfig, for_mode
from diloco.train.config import ModelConfig, TrainConfig

OUT = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def field_docs(cls) -> dict[str, str]:
    """The string literal under each field of a dataclass: the attribute docstring convention."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def default(f) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    if f.default_factory is not MISSING:
        return repr(f.default_factory())
    return "required"


def table(cls, extra_columns: dict[str, dict] | None = None) -> str:
    docs = field_docs(cls)
    extra = extra_columns or {}
    head = ["field", "default", *extra, "meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in fields(cls):
        cells = [f"`{f.name}`", f"`{default(f)}`", *(f"`{values[f.name]!r}`" for values in extra.values()),
                 docs.get(f.name, "").replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render() -> str:
    modes = {m: vars(for_mode(m, 4)) for m in ("decoupled", "streaming", "diloco")}
    modes["decoupled, --preset paper"] = vars(for_mode("decoupled", 4, preset="paper"))
    return "\n\n".join([
        "# Configuration reference",
        "Generated from the dataclasses by `python -m diloco.config_doc`; do not edit by hand.",
        "## `SyncConfig`: synchronisation (syncer and learners)\n\nColumns per mode show the value each `--mode` "
        "selects for 4 learners (the last: decoupled under `--preset paper`, DESIGN §3 exactly); command-line "
        "flags override them. Fields whose description starts with *Ours* are this project's additions to the "
        "published algorithm: each is a switch, and `--preset paper` turns every one off.",
        table(SyncConfig, modes),
        "## `TrainConfig`: the built-in trainer",
        table(TrainConfig),
        "## `ModelConfig`: the built-in model",
        table(ModelConfig),
    ]) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
