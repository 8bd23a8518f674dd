"""The constants reference of docs/simulation.md, generated from the dataclasses and presets.

    python -m diloco.sim.constants_doc
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

from diloco.sim.world import FailureModel, TrainingModel
from diloco.sim.presets import PRESETS


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string right after each field), which Python does not keep at run time."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _value(v) -> str:
    if v is None:
        return "auto"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 1e5 else f"{v:g}"
    return str(v)


def constants_table() -> str:
    presets = list(PRESETS.values())
    lines = ["| constant | " + " | ".join(p.name for p in presets) + " | meaning | source (paper-aggressive; "
             "llama3-observed where it differs) |",
             "|---|" + "---|" * len(presets) + "---|---|"]
    for cls, part in ((FailureModel, "failures"), (TrainingModel, "training")):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            values = [_value(getattr(getattr(p, part), f.name)) for p in presets]
            sources = []
            for p in presets:
                source = p.sources.get(f.name, "")
                if source and source not in sources:
                    sources.append(source)
            lines.append(f"| `{f.name}` | " + " | ".join(values) + f" | {docs.get(f.name, '')} | "
                         + "; ".join(sources) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(constants_table())
