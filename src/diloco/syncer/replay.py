"""Replaying a tape: the round policy and the merge weights recomputed from what each round close recorded, to
see where this code would decide differently from the syncer that wrote the tape (`diloco replay TAPE`).

Every `round` event of the tape carries the policy's inputs at its close (contributors, open and quorum times,
live learners, moving averages, predicted pushes) and each contributor's counters and weight; the run's
configuration is in the `start` event. Closes forced at shutdown or by a learner's second push (`--repeat-push
close`) are not policy decisions and are only counted.

The syncer acts on each decision as of when the policy had it due, however late it wakes up: a round's close
records that time (`due`, beside `now`, when the syncer acted), and a push that arrives after it is let in only
once the round is closed (`SyncerCore._close_if_due`). Each push let into an open round records what the policy was
asked then (`check`: the contributors present, the learners awaited, the moving averages, the predicted pushes)
and its arrival time (`at`). So the replay asks the policy again exactly what the syncer asked it: at every push
let in (it must have let it in: a close due before its arrival is a round this code closes earlier, with fewer
contributors), and at the close as of its due time (it must close, for the same reason, due at the same time).
Times on the tape are rounded to the microsecond, which is all the tolerance an unmodified run needs; `slack`
leaves out closes a changed policy makes earlier by at most that many seconds. How late the syncer acted on each
due close (`now` − `due`, its wake-up latency) is reported apart (`wake_up_latency`): it changes no decision."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from diloco.config import SyncConfig
from diloco.algorithm.merge import token_weight
from diloco.algorithm.policy import Averages, RoundState, decide
from diloco.syncer.rounds import counted_as


@dataclass(frozen=True)
class Difference:
    fragment: int
    version: int
    what: str


SLACK = 0.0
"""Seconds by which a changed policy's close must come before the recorded one to count as a difference (0: any)."""
EPS = 2e-6
"""The tape rounds times to the microsecond: two times computed from rounded ones may differ by this much."""


def _quorum_at(first: list[float], quorum: int) -> float | None:
    """When a round whose contributors came in at `first` (in order) reached a quorum of `quorum` (None: not)."""
    return first[quorum - 1] if 0 < quorum <= len(first) else None


def _earlier(when: float, due: float, k: int, n: int, reason: str) -> str:
    """A close this code's policy had due at `when`, before the syncer's at `due`, with `k` of `n` contributors; in
    milliseconds, or microseconds where that is the difference."""
    p = 3 if abs(due - when) >= 0.0005 else 6
    return (f"would have closed {due - when:.{p}f} s earlier, at {when:.{p}f} s with {k} of {n} contributors "
            f"({reason}); the syncer's close was due at {due:.{p}f} s")


def check_round(contributors: list[dict], decision: dict, cfg: SyncConfig, slack: float = SLACK) -> str | None:
    """Where this code's policy decides a recorded round differently (None: nowhere): asked again what the syncer
    asked it, at every push let into the round (`check`) and at its close as of its due time."""
    policy, n = cfg.policy(), len(contributors)
    due = decision.get("due", decision["now"])  # a tape from before due times: when the syncer acted
    # when each contributor came into the round: one that replaced earlier pushes of its learner, at the first
    first = [c.get("since", c.get("at")) for c in contributors]
    arrivals = None not in first
    for c in contributors if arrivals else []:
        check = c.get("check")
        if check is None:  # a round's first push, or one from before checks were recorded
            continue
        k = check["present"]
        state = RoundState(frozenset(x["learner"] for x in contributors[:k]), decision["opened_at"],
                           _quorum_at(first[:k], policy.quorum))
        d = decide(state, frozenset(check.get("live", decision["live"])), Averages(**check["averages"]), c["at"],
                   policy, check["expected"])
        if not d.close:
            continue
        # the latest push then (one replaced since arrived, for all the tape says, when it came in)
        since = max(x["at"] if x["at"] < c["at"] else f for x, f in zip(contributors[:k], first[:k]))
        when = since if d.due_at is None else max(d.due_at, since)
        if when < c["at"] - EPS and when < due - max(slack, EPS):
            return _earlier(when, due, k, n, d.reason)
    quorum_at = _quorum_at(first, policy.quorum) if arrivals else decision["quorum_at"]
    state = RoundState(frozenset(c["learner"] for c in contributors), decision["opened_at"], quorum_at)
    d = decide(state, frozenset(decision["live"]), Averages(**decision["averages"]), due + EPS, policy,
               decision["expected"])
    if not d.close:
        return f"would still wait ({d.reason}); the syncer closed: {decision['reason']}"
    if d.reason != decision["reason"]:
        return f"closes because {d.reason}; the syncer: {decision['reason']}"
    if "due" not in decision or not arrivals:
        return None
    since = max(c["at"] for c in contributors)
    if not since - EPS <= due <= decision["now"] + EPS:  # each push was let in because the round was not due
        return (f"due at {due:.6f} s, not between its latest push ({since:.6f} s) and its close "
                f"({decision['now']:.6f} s)")
    if d.due_at is None:  # due at the latest push, or when a learner left or turned absent after it
        return None
    when = max(d.due_at, since)
    if abs(when - due) > max(slack, EPS):
        return _earlier(when, due, n, n, d.reason)
    return None


def wake_up_latency(events: list[dict]) -> list[float]:
    """Seconds between when the policy had each round's close due and when the syncer closed it (`now` − `due`), for
    every policy decision the tape records both of."""
    return [round(e["decision"]["now"] - e["decision"]["due"], 6) for e in events
            if e.get("event") == "round" and e.get("decision") and e["decision"].get("due") is not None
            and e["decision"]["reason"] not in ("forced", "repeat")]


def latency_summary(latencies: list[float]) -> str:
    """`diloco replay`'s line on the wake-up latency."""
    if not latencies:
        return "wake-up latency: no due times on the tape"
    return (f"wake-up latency (close − due, not a difference): median {statistics.median(latencies):.3f} s, "
            f"max {max(latencies):.3f} s over {len(latencies)} closes")


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
            what = check_round(contributors, decision, cfg, slack)
            if what is not None:
                differences.append(Difference(fragment, version, what))
        for c in contributors:
            if "weight" not in c:
                continue
            # counters bounded against other learners' history (which a tape does not hold) are taken as recorded
            counted = c["counted"] if c.get("bounded") else counted_as(c["tokens"], c["steps"], cfg)
            # the direction and agreement tests' factors depend on other learners' history too: taken as recorded
            weight = c.get("direction", 1.0) * c.get("agreement", 1.0) * token_weight(*counted, c["staleness"], cfg.staleness_decay)
            if abs(weight - c["weight"]) > 1e-9 * max(1.0, abs(weight)):
                differences.append(Difference(fragment, version, f"{c['learner']}'s weight {weight:.6g}; the syncer "
                                                                 f"used {c['weight']:.6g}"))
    return replayed, differences
