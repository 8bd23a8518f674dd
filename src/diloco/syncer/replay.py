"""Replaying a tape: the round policy and the merge weights recomputed from what each round close recorded, to
see where this code would decide differently from the syncer that wrote the tape (`diloco replay TAPE`).

Every `round` event of the tape carries the policy's inputs at its close (contributors, open and quorum times,
live learners, moving averages, predicted pushes) and each contributor's counters and weight; the run's
configuration is in the `start` event. Closes forced at shutdown or by a learner's second push are not policy
decisions and are only counted."""

from __future__ import annotations

import json
from dataclasses import dataclass

from diloco.config import SyncConfig
from diloco.merge import token_weight
from diloco.policy import Averages, RoundState, decide
from diloco.syncer.rounds import counted_as


@dataclass(frozen=True)
class Difference:
    fragment: int
    version: int
    what: str


def replay(events: list[dict]) -> tuple[int, list[Difference]]:
    """(rounds replayed, where this code differs). Raises ValueError when the tape has no configuration."""
    cfg = None
    replayed, differences = 0, []
    for e in events:
        if e.get("event") == "start":
            cfg = SyncConfig.from_json(json.dumps(e["config"]))
        if e.get("event") != "round" or not e.get("decision"):
            continue
        if cfg is None:
            raise ValueError("the tape has no start event with the run's configuration (it was rotated away?)")
        replayed += 1
        fragment, version, decision = e["fragment"], e["version"], e["decision"]
        contributors = e.get("contributors", [])
        if decision["reason"] not in ("forced", "repeat"):
            state = RoundState(frozenset(c["learner"] for c in contributors), decision["opened_at"],
                               decision["quorum_at"])
            d = decide(state, frozenset(decision["live"]), Averages(**decision["averages"]), decision["now"],
                       cfg.policy(), decision["expected"])
            if not d.close:
                differences.append(Difference(fragment, version, f"would still wait ({d.reason}); the syncer closed: "
                                                                 f"{decision['reason']}"))
            elif d.reason != decision["reason"]:
                differences.append(Difference(fragment, version, f"closes because {d.reason}; the syncer: "
                                                                 f"{decision['reason']}"))
        for c in contributors:
            if "weight" not in c:
                continue
            weight = token_weight(*counted_as(c["tokens"], c["steps"], cfg), c["staleness"], cfg.staleness_decay)
            if abs(weight - c["weight"]) > 1e-9 * max(1.0, abs(weight)):
                differences.append(Difference(fragment, version, f"{c['learner']}'s weight {weight:.6g}; the syncer "
                                                                 f"used {c['weight']:.6g}"))
    return replayed, differences
