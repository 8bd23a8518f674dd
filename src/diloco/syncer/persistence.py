"""What of a SyncerCore goes to disk and how it comes back (docs/algorithm.md §8); the files themselves are store.py's."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import torch

from diloco.atomic import Chunked
from diloco.config import SyncConfig
from diloco.algorithm.fragments import TensorSpec, plan_fragments
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.ledger import LearnerRecord
from diloco.syncer.at_rest.store import Damaged, Loaded, StateError, fragment_version

log = logging.getLogger("diloco.syncer")


def ledger(core) -> dict:
    """Everything but the fragment tensors, as JSON-ready data."""
    now = core.clock()
    return {
        "config": json.loads(core.cfg.to_json()),
        "shard": list(core.shard),
        "specs": [[s.name, list(s.shape), s.dtype, s.embedding, s.kind, s.alias_of] for s in core.specs or []],
        "versions": [fs.version for fs in core.fragments],
        "pending_share": [fs.pending_share for fs in core.fragments],
        "rounds": core.rounds,
        "started_unix": core.started_unix,
        "elapsed_since_training_started": None if core.training_started_at is None else now - core.training_started_at,
        "quorum_avg": core.quorum_avg.value,
        "sync_avg": core.sync_avg.value,
        "refusals": core.refusals,
        "learners": [r.to_json() for r in core.learners.values()],
        "departed_tokens": dict(core.departed),
    }


EMPTY = torch.zeros(0)
PIECE = 1 << 20
"""Values of Θ made and written at a time when it is kept as P + residual (4 MB)."""


def theta_pieces(fs) -> torch.Tensor | Chunked:
    """Θ of a fragment to write: the kept tensor, or P + residual made a piece at a time as it is written (a whole
    temporary of the embedding fragment was a third of GPT-2's transient peak)."""
    if fs.residual is None:
        return fs.theta
    published, residual = fs.published, fs.residual
    n = published.numel()
    return Chunked((n,), torch.float32, lambda: (published[lo : lo + PIECE] + residual[lo : lo + PIECE]
                                                  for lo in range(0, n, PIECE)))


def persist(core, changed) -> None:
    """Write the ledger and the `changed` fragments (and any a failed write left unsaved).

    A full or read-only state directory (OSError) is logged at once with the path and errno (then once per
    `throttle.INTERVAL`, with a count), recorded as `core.state_error` (/status shows the syncer unhealthy) and
    retried with the next round; it is not raised:
    SyncerCore._close persists after the round has changed the fragment in memory, and an exception there would
    lose the round's publications and stop the loop that closes rounds. The round is published without being
    durable, and becomes durable with the first write that succeeds."""
    if core.store is None or not core.initialized:
        return
    todo = set(changed) | getattr(core, "unsaved_fragments", set())
    tensors = {}
    for i in sorted(todo):
        fs = core.fragments[i]
        if core.cfg.keeps_outer_state:
            pending = fs.pending_delta if fs.pending_delta is not None else torch.zeros_like(fs.momentum)
            momentum = fs.momentum
        else:  # with μ = 0 neither ever moves Θ again: only Θ is written, a third of the bytes
            momentum = pending = EMPTY
        tensors[i] = (fs.version, {"theta": theta_pieces(fs), "momentum": momentum, "pending_delta": pending})
    try:
        core.store.save(ledger(core), tensors)
    except OSError as e:
        core.unsaved_fragments = todo
        where = e.filename or core.store.folder
        error = (f"cannot write the syncer state to {where}: [Errno {e.errno}] {e.strerror or e}; rounds since "
                 f"then are published but not durable (retried every round)")
        core.store.errors.error("state", error)
        core.state_error = error
        return
    core.unsaved_fragments = set()
    if getattr(core, "state_error", None):
        left_out = core.store.errors.recovered("state")
        log.warning("the state directory %s takes writes again: the syncer state is durable again (versions %s)%s",
                    core.store.folder, [fs.version for fs in core.fragments],
                    f"; {left_out} failed writes were not logged" if left_out else "")
        core.state_error = None


def config_differences(stored: SyncConfig, given: SyncConfig) -> list[str]:
    return [f"{f.name}: stored {getattr(stored, f.name)!r}, given {getattr(given, f.name)!r}"
            for f in dataclasses.fields(SyncConfig) if getattr(stored, f.name) != getattr(given, f.name)]


def _parse(led: dict, ledger_name: str):
    """(config, specs) of a ledger, or Damaged."""
    try:
        cfg = SyncConfig(**led["config"])
        specs = [TensorSpec(n, tuple(shape), dtype, emb, *rest) for n, shape, dtype, emb, *rest in led["specs"]]
        layout = plan_fragments(specs, cfg.fragments, cfg.split_tensors)
        for key in ("versions", "pending_share", "rounds", "refusals", "learners", "quorum_avg", "sync_avg",
                    "started_unix"):
            led[key]
    except (KeyError, TypeError, ValueError) as e:
        raise Damaged(ledger_name, f"not a syncer ledger ({type(e).__name__}: {e})") from None
    return cfg, specs, layout


def _shard(led: dict, ledger_name: str) -> tuple[int, int]:
    shard = led.get("shard", [0, 1])  # states written before sharding hold every fragment
    if not (isinstance(shard, list) and len(shard) == 2 and all(isinstance(x, int) for x in shard)
            and 0 <= shard[0] < shard[1]):
        raise Damaged(ledger_name, f"names no valid shard ({shard!r})")
    return shard[0], shard[1]


def check(loaded: Loaded) -> None:
    """What the ledger implies of the fragment files: one per fragment, at the ledger's version (file names carry
    it), with the tensors and shapes of that fragment. Raises Damaged naming the file."""
    led, ledger_name = loaded.ledger, loaded.files["ledger"]
    cfg, _, layout = _parse(led, ledger_name)
    versions = led["versions"]
    shard, shards = _shard(led, ledger_name)
    if not isinstance(versions, list) or len(versions) != len(layout) or len(led["pending_share"]) != len(layout):
        raise Damaged(ledger_name, f"lists {len(versions) if isinstance(versions, list) else '?'} fragment versions "
                                   f"but its model has {len(layout)} fragments")
    for fragment in layout:
        i = fragment.index
        if i % shards != shard:
            continue  # another shard's fragment: no file here
        name = loaded.files.get(f"fragment-{i}")
        if name is None or i not in loaded.fragments:
            raise Damaged(ledger_name, f"fragment {i} has no file in the manifest")
        _, file_version = fragment_version(name)
        if versions[i] != file_version:
            raise Damaged(ledger_name, f"says fragment {i} is at version {versions[i]!r} but its file is {name} "
                                       f"(version {file_version})")
        t = loaded.fragments[i]
        missing = {"theta", "momentum", "pending_delta"} - set(t)
        if missing:
            raise Damaged(name, f"lacks tensors {sorted(missing)}")
        n = fragment.numel
        outer = fragment.role == "params" and cfg.keeps_outer_state
        expected = {"theta": (n,), "momentum": (n,) if outer else (0,)}
        expected["pending_delta"] = expected["momentum"]
        for key, shape in expected.items():
            if tuple(t[key].shape) != shape:
                raise Damaged(name, f"tensor {key!r} has shape {tuple(t[key].shape)}, fragment {i} of the ledger's "
                                    f"model needs {shape} (a file of another fragment or model?)")


def restore(core) -> bool:

    loaded = core.store.load(check) if core.store else None
    if loaded is None:
        return False
    led, now = loaded.ledger, core.clock()
    stored_cfg, specs, layout = _parse(led, loaded.files["ledger"])
    stored_shard = _shard(led, loaded.files["ledger"])
    if stored_shard != tuple(core.shard):
        raise StateError(f"state directory {core.store.folder} belongs to syncer shard {stored_shard[0]}/"
                         f"{stored_shard[1]}, not {core.shard[0]}/{core.shard[1]}: give each shard its own --state "
                         f"directory, and restart it with the --shard it was started with")
    if stored_cfg != core.cfg:
        log.warning("resuming with the stored run configuration, not the one given (the run's identity is the "
                    "stored one): %s", "; ".join(config_differences(stored_cfg, core.cfg)))
        core.cfg = stored_cfg
    core.specs = specs
    core.fragments = []
    for i, fragment in enumerate(layout):
        if not core.owns(i):
            core.fragments.append(FragmentState(fragment, torch.zeros(0), torch.zeros(0), led["versions"][i]))
            continue
        t = loaded.fragments[i]
        momentum, pending = t["momentum"], t["pending_delta"]
        if fragment.role == "params" and not stored_cfg.keeps_outer_state:  # neither written nor kept
            momentum, pending = EMPTY, None
        fs = FragmentState(fragment, t["theta"], momentum, led["versions"][i], guard=core.norm_guard(fragment),
                           direction=core.direction_guard(fragment))
        fs.pending_delta, fs.pending_share = pending, led["pending_share"][i]
        core.fragments.append(fs)
    core.bound_buffers()
    core.rounds, core.refusals = led["rounds"], led["refusals"]
    # a crash between appending a round's line and persisting the round leaves a line for a version that was
    # never published; it is produced again after the restart, so the history keeps only what the state holds
    kept = [e for e in core.store.rounds(core.round_log.maxlen)
            if len(e) == 4 and isinstance(e[1], int) and 0 <= e[1] < len(core.fragments)
            and isinstance(e[2], int) and e[2] <= core.fragments[e[1]].version]
    try:
        core.store.rewrite_rounds(kept)
    except OSError as e:
        log.error("cannot rewrite %s: [Errno %s] %s", e.filename, e.errno, e.strerror)
    core.round_log.extend(kept)
    core.quorum_avg.value, core.sync_avg.value = led["quorum_avg"], led["sync_avg"]
    core.started_unix = led["started_unix"]
    core.started_at = now - (time.time() - core.started_unix)
    elapsed = led.get("elapsed_since_training_started", led.get("elapsed_since_first_join"))  # older states
    if isinstance(elapsed, (int, float)) and 0 <= elapsed < float("inf"):
        core.training_started_at = now - elapsed
    core.learners = {d["id"]: LearnerRecord.from_json(d, now) for d in led["learners"]}
    core.departed = _departed(led.get("departed_tokens", core.departed), loaded.files["ledger"])  # older: none
    return True


def _departed(value, ledger_name: str) -> dict:
    """The forgotten learners' tokens of a ledger: three counts, none negative or infinite."""
    if (not isinstance(value, dict) or set(value) != {"trained", "budget", "merged"}
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 2**63 for v in value.values())):
        raise Damaged(ledger_name, f"departed_tokens is not three token counts ({value!r})")
    return {"trained": int(value["trained"]), "budget": float(value["budget"]), "merged": float(value["merged"])}
