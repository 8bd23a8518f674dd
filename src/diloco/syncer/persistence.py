"""What of a SyncerCore goes to disk and how it comes back (DESIGN §3.8); the files themselves are store.py's."""

from __future__ import annotations

import json
import logging
import time

import torch

from diloco.config import SyncConfig
from diloco.fragments import TensorSpec, plan_fragments
from diloco.syncer.ledger import LearnerRecord

log = logging.getLogger("diloco.syncer")


def ledger(core) -> dict:
    """Everything but the fragment tensors, as JSON-ready data."""
    now = core.clock()
    return {
        "config": json.loads(core.cfg.to_json()),
        "specs": [[s.name, list(s.shape), s.dtype, s.embedding, s.kind, s.alias_of] for s in core.specs or []],
        "versions": [fs.version for fs in core.fragments],
        "pending_share": [fs.pending_share for fs in core.fragments],
        "rounds": core.rounds,
        "started_unix": core.started_unix,
        "elapsed_since_first_join": None if core.first_join_at is None else now - core.first_join_at,
        "quorum_avg": core.quorum_avg.value,
        "sync_avg": core.sync_avg.value,
        "refusals": core.refusals,
        "learners": [r.to_json() for r in core.learners.values()],
    }


def persist(core, changed) -> None:
    if core.store is None or not core.initialized:
        return
    tensors = {}
    for i in changed:
        fs = core.fragments[i]
        pending = fs.pending_delta if fs.pending_delta is not None else torch.zeros_like(fs.momentum)
        tensors[i] = (fs.version, {"theta": fs.theta, "momentum": fs.momentum, "pending_delta": pending})
    core.store.save(ledger(core), tensors)


def restore(core) -> bool:
    from diloco.syncer.core import ROUND_LOG_KEPT, FragmentState

    loaded = core.store.load() if core.store else None
    if loaded is None:
        return False
    led, now = loaded.ledger, core.clock()
    stored_cfg = SyncConfig(**led["config"])
    if stored_cfg != core.cfg:
        log.warning("resuming with the stored run configuration, not the one given on the command line")
        core.cfg = stored_cfg
    core.specs = [TensorSpec(n, tuple(shape), dtype, emb, *rest) for n, shape, dtype, emb, *rest in led["specs"]]
    core.fragments = []
    for i, fragment in enumerate(plan_fragments(core.specs, core.cfg.fragments)):
        t = loaded.fragments[i]
        fs = FragmentState(fragment, t["theta"], t["momentum"], led["versions"][i])
        fs.pending_delta, fs.pending_share = t["pending_delta"], led["pending_share"][i]
        core.fragments.append(fs)
    core.rounds, core.refusals = led["rounds"], led["refusals"]
    # a crash between appending a round's line and persisting the round leaves a line for a version that was
    # never published; it is produced again after the restart, so the history keeps only what the state holds
    kept = [e for e in core.store.rounds(ROUND_LOG_KEPT) if e[2] <= core.fragments[e[1]].version]
    core.store.rewrite_rounds(kept)
    core.round_log.extend(kept)
    core.quorum_avg.value, core.sync_avg.value = led["quorum_avg"], led["sync_avg"]
    core.started_unix = led["started_unix"]
    core.started_at = now - (time.time() - core.started_unix)
    if led["elapsed_since_first_join"] is not None:
        core.first_join_at = now - led["elapsed_since_first_join"]
    core.learners = {d["id"]: LearnerRecord.from_json(d, now) for d in led["learners"]}
    return True
