"""The shards of a sharded syncer seen as one syncer: a combined /status for the live display, and, after the run,
one model, one series of snapshots and one syncer.json for the report (docs/architecture.md, Sharded syncers)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file

from diloco.atomic import save_tensors, write_json

SUMMED = ("rounds", "tokens_merged", "wire_bytes")
"""Counters each shard keeps for its own fragments (or its own connections): the run's are their sums."""


def combined_status(statuses: list[dict]) -> dict:
    """One status from every shard's: each fragment's version and pending count from its owner, counters summed,
    membership and budget from shard 0 (every shard hears the same heartbeats), stopping when any shard stops."""
    out = dict(statuses[0])
    for key in SUMMED:
        out[key] = sum(s.get(key) or 0 for s in statuses)
    for key in ("versions", "pending"):
        values = list(statuses[0].get(key, []))
        for s in statuses:
            for p in s.get("owned_fragments", []):
                if p < len(values):
                    values[p] = s[key][p]
        out[key] = values
    out["stopping"] = any(s.get("stopping") for s in statuses)
    out["refusals"] = {}
    for s in statuses:
        for reason, n in (s.get("refusals") or {}).items():
            out["refusals"][reason] = out["refusals"].get(reason, 0) + n
    out["shards"] = len(statuses)
    return out


def _metadata(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def merge_models(paths: list[Path], target: Path, summed: tuple[str, ...] = ()) -> None:
    """The union of the shards' tensors in one file; metadata from the first, `summed` keys added up."""
    tensors, metadata = {}, _metadata(paths[0])
    for path in paths:
        tensors.update(load_file(path))
    for key in summed:
        metadata[key] = str(sum(float(_metadata(p).get(key, 0)) for p in paths))
    save_tensors(target, tensors, metadata)


def combine_outputs(shard_dirs: list[Path], target: Path) -> dict:
    """Write into `target` what one syncer would have: model.safetensors, snapshots (the k-th of every shard
    together: they are taken on the same schedule) and syncer.json. Returns the combined syncer.json."""
    statuses = [json.loads((d / "syncer.json").read_text()) for d in shard_dirs]
    status = combined_status(statuses)
    status["round_log"] = sorted(entry for s in statuses for entry in s.get("round_log", []))
    status["started_unix"] = min(s["started_unix"] for s in statuses)
    merge_models([d / "model.safetensors" for d in shard_dirs], target / "model.safetensors", ("tokens_merged",))
    series = [sorted((d / "snapshots").glob("*.safetensors")) for d in shard_dirs]
    (target / "snapshots").mkdir(parents=True, exist_ok=True)
    for k in range(min(len(s) for s in series)):
        paths = [s[k] for s in series]
        merge_models(paths, target / "snapshots" / paths[0].name, ("tokens_merged", "rounds", "wire_bytes"))
    write_json(target / "syncer.json", status, indent=2)
    return status
