"""Replaying a tape: the round policy and the merge weights recomputed from what each round close recorded, to
see where this code would decide differently from the syncer that wrote the tape (`diloco replay TAPE`).

Every `round` event of the tape carries the policy's inputs at its close (contributors, open and quorum times,
live learners, moving averages, predicted pushes) and each contributor's counters and weight; the run's
configuration is in the `start` event. Closes forced at shutdown or by a learner's second push (`--repeat-push
close`) are not policy decisions and are only counted.

Each contributor's arrival time is recorded too, so the replay also asks whether this code would have closed a
round *earlier*: it evaluates the policy at every arrival and at every deadline the policy names in between, with
the live learners recorded at the close and the moving averages and predicted pushes recorded when the round
reached quorum (what its grace window was first set from). An earlier close by more than `slack` seconds (the
syncer's wake-up latency, and the moving averages' drift during the round) is a difference."""

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


SLACK = 0.5
"""Seconds by which a replayed close must come before the recorded one to count as a difference."""


def earliest_close(contributors: list[dict], decision: dict, cfg: SyncConfig) -> tuple[float, int, str] | None:
    """(time, contributors then, reason) of the first moment this code's policy closes the round, from the
    contributors' arrival times; None when that is not before the recorded close, or arrivals were not recorded."""
    # a contributor that replaced earlier pushes of its learner has been in the round since the first of them
    arrivals = sorted((c.get("since", c["at"]), c["learner"]) for c in contributors if c.get("at") is not None)
    if not arrivals or len(arrivals) != len(contributors):
        return None
    policy, live = cfg.policy(), frozenset(decision["live"])
    inputs = decision.get("at_quorum") or decision  # as the grace window was first set, when recorded
    avg, expected, closed = Averages(**inputs["averages"]), inputs["expected"], decision["now"]
    present: set[str] = set()
    quorum_at = None
    for i, (at, learner) in enumerate(arrivals):
        present.add(learner)
        if quorum_at is None and len(present) >= policy.quorum:
            quorum_at = at
        until = arrivals[i + 1][0] if i + 1 < len(arrivals) else closed
        d = decide(RoundState(frozenset(present), decision["opened_at"], quorum_at), live, avg, at, policy, expected)
        when = at if d.close else d.wake_at if d.wake_at is not None and d.wake_at < until else None
        if when is not None and when < closed:
            reason = d.reason if d.close else "grace window ended"
            return when, len(present), reason
    return None


def replay(events: list[dict], slack: float = SLACK) -> tuple[int, list[Difference]]:
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
            early = earliest_close(contributors, decision, cfg)
            if early is not None and early[0] < decision["now"] - slack:
                differences.append(Difference(fragment, version, (
                    f"would have closed {decision['now'] - early[0]:.3f} s earlier, at {early[0]:.3f} s with "
                    f"{early[1]} of {len(contributors)} contributors ({early[2]}); the syncer closed at "
                    f"{decision['now']:.3f} s")))
        for c in contributors:
            if "weight" not in c:
                continue
            # counters bounded against other learners' history (which a tape does not hold) are taken as recorded
            counted = c["counted"] if c.get("bounded") else counted_as(c["tokens"], c["steps"], cfg)
            # the direction test's factor depends on other learners' history too: taken as recorded
            weight = c.get("direction", 1.0) * token_weight(*counted, c["staleness"], cfg.staleness_decay)
            if abs(weight - c["weight"]) > 1e-9 * max(1.0, abs(weight)):
                differences.append(Difference(fragment, version, f"{c['learner']}'s weight {weight:.6g}; the syncer "
                                                                 f"used {c['weight']:.6g}"))
    return replayed, differences
