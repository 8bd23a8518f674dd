"""`--config FILE.toml` for run, syncer, learner and compare, and `--print-config`.

A file's keys are the command's flags, spelt as their Python names (`--sync-every` is `sync_every`). Settings of
the synchronisation (every `SyncConfig` field, flag or not) sit in a `[sync]` table and those of the built-in
trainer (every `TrainConfig` field) in `[train]`; the rest at the top. File values become the parser's defaults,
so a flag on the command line overrides the file. The tables' keys come from the dataclasses themselves: a field
added to SyncConfig is a valid `[sync]` key with no change here.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from diloco import secret_sources, untrusted_files

log = logging.getLogger("diloco.config")

TABLES = {"run": ("sync", "train"), "syncer": ("sync",), "learner": ("train",), "compare": ()}
"""The tables each command's file may have."""
MAX_BYTES = 1 << 20
"""Largest --config file read (a full one is a few KB)."""
SECRET_KEYS = {dest: variables[0] for dest, variables in secret_sources.SOURCES.items()}
"""Keys whose values are secrets: warned about in a file, never printed (diloco/secret_sources.py)."""
NOT_SETTINGS = {"help", "config", "print_config", "sync_config"}
"""Flags that say what to do with settings rather than being one (and the syncer's private --sync-config)."""


class ConfigError(ValueError):
    """A file that cannot be used as it is; the message names the file and the key."""


@dataclass
class Settings:
    flags: dict = field(default_factory=dict)
    """Flag values by destination, converted as the flag's own type would."""
    sync: dict = field(default_factory=dict)
    """[sync] fields that no flag sets."""
    train: dict = field(default_factory=dict)
    """[train] fields that no flag sets."""


def dataclass_of(table: str):
    if table == "sync":
        from diloco.config import SyncConfig

        return SyncConfig
    from diloco.train.train_config import TrainConfig

    return TrainConfig


def settings_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions  # argparse keeps no public list of a parser's flags
            if a.option_strings and a.dest not in NOT_SETTINGS and a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def layout(command: str, parser: argparse.ArgumentParser) -> dict[str, dict[str, object]]:
    """{table ("" for the top level): {key: the flag's Action, or the dataclass field's type}}."""
    tables = {t: typing.get_type_hints(dataclass_of(t)) for t in TABLES.get(command, ())}
    out: dict[str, dict[str, object]] = {"": {}, **{t: {} for t in tables}}
    for action in settings_actions(parser):
        home = next((t for t, hints in tables.items() if action.dest in hints), "")
        out[home][action.dest] = action
    for t, hints in tables.items():
        for name, hint in hints.items():
            out[t].setdefault(name, hint)
    return out


def key_text(table: str, key: str) -> str:
    return f"[{table}] {key}" if table else key


def load(path: Path, command: str, parser: argparse.ArgumentParser) -> Settings:
    try:
        data = untrusted_files.read_toml(path, MAX_BYTES)
    except untrusted_files.UntrustedFileError as e:
        raise ConfigError(f"--config {path}: {e.why}") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it: {e.strerror}") from None
    keys = layout(command, parser)
    settings = Settings()
    for table, values in [("", {k: v for k, v in data.items() if not (k in keys and k and isinstance(v, dict))}),
                          *((t, data[t]) for t in keys if t and t in data)]:
        if table and not isinstance(values, dict):
            raise ConfigError(f"{path}: {table} must be a table ([{table}]), got {type_name(values)}")
        for key, value in values.items():
            where = f"{path}: {key_text(table, key)}"
            if not table and isinstance(value, dict):
                tables = " and ".join(f"[{t}]" for t in keys if t) or "no tables"
                raise ConfigError(f"{path}: unknown table [{key}] for diloco {command} (it takes {tables})")
            if key not in keys[table]:
                raise ConfigError(f"{path}: unknown key {key_text(table, key)} for diloco {command}"
                                  f"{suggest(key, keys)}")
            spec = keys[table][key]
            if not table and key in SECRET_KEYS:
                log.warning("%s holds the secret %r: a config file gets shared; put it in %s_file or $%s instead",
                            path, key, key, SECRET_KEYS[key])
            if isinstance(spec, argparse.Action):
                settings.flags[spec.dest] = flag_value(spec, value, where)
            else:
                getattr(settings, table)[key] = field_value(spec, value, where)
    return settings


def suggest(key: str, keys: dict[str, dict]) -> str:
    everywhere = {key_text(t, k): k for t, ks in keys.items() for k in ks}
    close = difflib.get_close_matches(key, list(everywhere.values()), n=1, cutoff=0.6)
    if not close:
        return "; see `--print-config` or docs/config.md for the keys"
    named = [text for text, k in everywhere.items() if k == close[0]]
    return f"; did you mean {named[0]}?"


def type_name(value) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__) + (f" ({value!r})" if not isinstance(value, (dict, list)) else "")


def expect(where: str, wanted: str, value):
    raise ConfigError(f"{where} must be {wanted}, got {type_name(value)}")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flag_value(action: argparse.Action, value, where: str):
    """`value` from a file as the flag would have made it from the command line."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        return value if isinstance(value, bool) else expect(where, "true or false", value)
    if action.nargs in ("+", "*"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or not (value or action.nargs == "*"):
            expect(where, "a list of strings", value)
        return [one_value(action, v, where) for v in value]
    return one_value(action, value, where)


def one_value(action: argparse.Action, value, where: str):
    kind = action.type
    if kind is int:
        converted = value if isinstance(value, int) and not isinstance(value, bool) else expect(where, "an integer", value)
    elif kind is float:
        converted = float(value) if is_number(value) else expect(where, "a number", value)
    elif kind in (None, str):
        converted = value if isinstance(value, str) else expect(where, "a string", value)
    elif kind is Path:
        converted = Path(value) if isinstance(value, str) else expect(where, "a string (a path)", value)
    else:  # the flag's own parser: HOST:PORT, I/N, seconds
        if not (isinstance(value, str) or is_number(value)):
            expect(where, f"a string ({action.metavar or action.dest.upper()})", value)
        try:
            converted = kind(str(value))
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: invalid choice {converted!r} (choose from {', '.join(map(repr, action.choices))})")
    return converted


def field_value(hint, value, where: str):
    """`value` from a file as a dataclass field of type `hint` (no flag sets it)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]  # Optional[X]: TOML has no None, so the value is an X
    origin = typing.get_origin(hint)
    if hint is bool:
        return value if isinstance(value, bool) else expect(where, "true or false", value)
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else expect(where, "an integer", value)
    if hint is float:
        return float(value) if is_number(value) else expect(where, "a number", value)
    if hint is str:
        return value if isinstance(value, str) else expect(where, "a string", value)
    if origin is tuple:
        parts = typing.get_args(hint)
        if not isinstance(value, list) or len(value) != len(parts):
            expect(where, f"a list of {len(parts)} values", value)
        return tuple(field_value(p, v, where) for p, v in zip(parts, value))
    if origin is list:
        (item,) = typing.get_args(hint)
        return [field_value(item, v, where) for v in value] if isinstance(value, list) else expect(where, "a list", value)
    raise ConfigError(f"{where}: this setting cannot be given in a file")


# ---- --print-config ---------------------------------------------------------------------------------------------

def toml_value(value) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string is a JSON string


def flag_text(action: argparse.Action, value):
    """A flag's value as the file spells it: what the flag's own parser reads back to the same value."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple) and action.metavar == "I/N":
        return f"{value[0]}/{value[1]}"
    if isinstance(value, list) and action.nargs not in ("+", "*"):  # HOST:PORT,HOST:PORT
        return ",".join(value)
    if isinstance(value, list):
        return [str(v) for v in value]
    return value


def effective(command: str, parser: argparse.ArgumentParser, args: argparse.Namespace,
              defaults: dict[str, object]) -> dict[str, list[tuple[str, object, bool]]]:
    """{table: [(key, value, given)]}: every setting's effective value, and whether the command line or a file
    gave it (the others are the defaults, or what --mode chose)."""
    from dataclasses import asdict

    keys = layout(command, parser)
    out: dict[str, list[tuple[str, object, bool]]] = {t: [] for t in keys}
    for table, specs in keys.items():
        for key, spec in specs.items():
            if isinstance(spec, argparse.Action) and not (table == "train" and key == "model"):
                value = getattr(args, spec.dest, None)
                if value is not None and (table == "" or not hasattr(resolved_table(command, args, table), key)):
                    out[table].append((key, flag_text(spec, value), value != defaults.get(spec.dest)))
    for table in keys:
        if not table:
            continue
        resolved = resolved_table(command, args, table)
        if resolved is None:
            continue
        given = {k for k, spec in keys[table].items() if isinstance(spec, argparse.Action) and getattr(args, spec.dest, None) is not None}
        given |= set(getattr(args, f"{table}_fields", {}))
        for key, value in asdict(resolved).items():
            if table == "train" and key == "model":
                size = model_name(resolved.model)
                if size is not None:
                    out[table].append((key, size, getattr(args, "model", None) is not None))
                continue
            if value is None:  # TOML has no None: left out, the setting keeps its default
                continue
            out[table].append((key, list(value) if isinstance(value, tuple) else value, key in given))
    return out


def model_name(model) -> str | None:
    """The size name of a model's shape (its options, --qk-norm and --z-loss, are keys of their own)."""
    from dataclasses import replace

    from diloco.options import model_config

    shape = replace(model, qk_norm=False, z_loss=0.0)
    return next((name for name in ("small", "tiny") if model_config(name) == shape), None)


def resolved_table(command: str, args: argparse.Namespace, table: str):
    """The SyncConfig or TrainConfig this command's settings give (None where it has none: dp's sync)."""
    cache = args.__dict__.setdefault("_resolved", {})
    if table not in cache:
        from diloco import options

        if table == "sync":
            cache[table] = None if args.mode == "dp" else options.resolved_sync_config(args)
        else:
            cache[table] = options.train_config(args)
    return cache[table]


def dump(command: str, parser: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict[str, object]) -> str:
    """The effective settings as a TOML file for `--config`: what was given as keys, defaults and what --mode
    chose as comments (so editing `mode` in the file still changes them)."""
    lines = [f"# diloco {command} --config FILE: the effective settings. Lines starting with # are defaults (or what",
             "# the mode chose); a key set here or on the command line overrides them. Keys: docs/config.md."]
    for table, entries in effective(command, parser, args, defaults).items():
        if not entries:
            continue
        lines += ["", f"[{table}]"] if table else [""]
        for key, value, given in entries:
            if not table and key in SECRET_KEYS:  # a printed file is shared: its secret stays where it came from
                if value:
                    lines.append(f"# {key} = (given; not printed: use {key}_file or ${SECRET_KEYS[key]})")
                continue
            lines.append(f"{'' if given else '# '}{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"
