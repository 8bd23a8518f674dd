"""Generates docs/config.md from the configuration dataclasses' field docstrings: `python -m diloco.config_doc`."""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from diloco.config import SyncConfig, for_mode
from diloco.train.train_config import ModelConfig, TrainConfig

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


def table(cls, extra_columns: dict[str, dict] | None = None, file_table: str | None = None) -> str:
    docs = field_docs(cls)
    extra = extra_columns or {}
    head = ["field", *(["in a --config file"] if file_table else []), "default", *extra, "meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in fields(cls):
        in_file = [f"`[{file_table}] {f.name}`" if f.name != "model" else "`[train] model` (a size name)"] if file_table else []
        cells = [f"`{f.name}`", *in_file, f"`{default(f)}`", *(f"`{values[f.name]!r}`" for values in extra.values()),
                 docs.get(f.name, "").replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flag_default(action) -> str:
    if action.default is None:
        return ""
    if isinstance(action.default, tuple) and action.metavar == "I/N":
        return f"`{action.default[0]}/{action.default[1]}`"
    return f"`{action.default!r}`" if not isinstance(action.default, Path) else f"`{action.default}`"


def file_value(action) -> str:
    """What a flag's value looks like in a TOML file."""
    if action.nargs == 0:
        return "true"
    if action.nargs in ("+", "*"):
        return '["...", ...]'
    if action.choices:
        return " or ".join(f'"{c}"' for c in action.choices).replace("|", "\\|")
    named = {"address": '"HOST:PORT"', "addresses": '"HOST:PORT,..."', "positive_seconds": "<number>",
             "shard_spec": '"I/N"'}
    if getattr(action.type, "__name__", "") in named:
        return named[action.type.__name__]
    return {int: "<integer>", float: "<number>"}.get(action.type, f'"{action.metavar or "..."}"')


def flags_table(command: str) -> str:
    """Every flag of `diloco COMMAND` by --help group, with the line a --config file gives it."""
    import argparse

    from diloco.cli import build_parser
    from diloco.config_file import TABLES, layout, settings_actions

    parser = build_parser().commands[command]
    keys = layout(command, parser)
    home = {spec.dest: t for t, specs in keys.items() for spec in specs.values() if isinstance(spec, argparse.Action)}
    settings = {id(a) for a in settings_actions(parser)}
    out = []
    for group in parser._action_groups:  # argparse keeps no public list of its groups
        rows = [a for a in group._group_actions if id(a) in settings]
        if not rows:
            continue
        out += [f"**{group.title}**", "", "| flag | in a --config file | default | meaning |", "|---|---|---|---|"]
        for a in rows:
            flag = ", ".join(f"`{o}`" for o in a.option_strings)
            t = home[a.dest]
            where = f"`{'[' + t + '] ' if t else ''}{a.dest} = {file_value(a)}`"
            meaning = " ".join((a.help or "").replace("%%", "%").split()).replace("|", "\\|")
            out.append(f"| {flag} | {where} | {flag_default(a)} | {meaning} |")
        out.append("")
    tables = " and ".join(f"`[{t}]`" for t in TABLES[command])
    head = f"### `diloco {command}`" + (f" (tables: {tables})" if tables else "")
    return head + "\n\n" + "\n".join(out).rstrip()


def render() -> str:
    modes = {m: vars(for_mode(m, 4)) for m in ("decoupled", "streaming", "diloco")}
    modes["decoupled, --preset paper"] = vars(for_mode("decoupled", 4, preset="paper"))
    return "\n\n".join([
        "# Configuration reference",
        "Generated from the dataclasses by `python -m diloco.config_doc`; do not edit by hand.",
        "## `SyncConfig`: synchronisation (syncer and learners)\n\nColumns per mode show the value each `--mode` "
        "selects for 4 learners (the last: decoupled under `--preset paper`, the published algorithm of docs/algorithm.md); command-line "
        "flags override them. Fields whose description starts with *Ours* are this project's additions to the "
        "published algorithm: each is a switch, and `--preset paper` turns every one off.",
        table(SyncConfig, modes, file_table="sync"),
        "## `TrainConfig`: the built-in trainer",
        table(TrainConfig, file_table="train"),
        "## `ModelConfig`: the built-in model",
        table(ModelConfig),
        "## Flags and config files",
        FILES,
        *(flags_table(command) for command in ("run", "syncer", "learner", "compare")),
    ]) + "\n"


FILES = """`diloco run`, `syncer`, `learner` and `compare` take `--config FILE.toml`: every flag of the command as a key
spelt as its Python name (`--sync-every 12` is `sync_every = 12`), the synchronisation settings in a `[sync]`
table and the built-in trainer's in `[train]`. `[sync]` takes every `SyncConfig` field above and `[train]` every
`TrainConfig` field, flag or not. A flag given on the command line overrides the file; an unknown key is refused
by name (with the nearest known one), a value of the wrong type names its key and the type wanted. `--print-config`
prints the effective settings as a file that `--config` takes: what was given as keys, the rest (defaults, and
what `--mode` chose) as comments. Examples: `examples/config/`.

```toml
# diloco run --config run.toml
learners = 4
duration = 120

[sync]
mode = "decoupled"
fragments = 8

[train]
model = "tiny"
batch_size = 16
```"""


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
