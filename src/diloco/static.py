"""Facts the command line needs from modules that import torch, read from their source instead of importing them,
so that `diloco --help` and a mistyped flag answer in a fraction of a second."""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache


@lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find the source of {module}")
    with open(spec.origin, encoding="utf-8") as f:
        return ast.parse(f.read(), spec.origin)


def constant(module: str, name: str):
    """The literal value assigned to `name` at the top level of `module` (a tuple of names, a number)."""
    for node in _tree(module).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    raise LookupError(f"{module} assigns no literal {name}")


def field_docs(module: str, cls: str) -> dict[str, str]:
    """The string literal under each field of dataclass `cls` in `module` (the attribute docstring convention)."""
    for node in _tree(module).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            docs = {}
            for field, after in zip(node.body, node.body[1:]):
                if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
                    docs[field.target.id] = " ".join(str(after.value.value).split())
            return docs
    raise LookupError(f"{module} defines no class {cls}")


def ours(module: str = "diloco.config", cls: str = "SyncConfig") -> frozenset[str]:
    """The settings this project adds to the published algorithm: their description starts with "Ours"."""
    return frozenset(name for name, doc in field_docs(module, cls).items() if doc.startswith("Ours"))
