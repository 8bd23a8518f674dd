"""Fault schedules: named presets or a scenario file, seeded and reproducible (times in seconds of the run)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("kill", "hang", "slow", "syncer-crash", "partition")
PRESETS = ("kill-one", "rolling-kills", "hang", "straggler", "syncer-crash", "partition", "random")


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after training starts."""
    kind: str
    """kill (SIGKILL, restarted under the same id after `duration`), hang (SIGSTOP for `duration`, then SIGCONT),
    slow (runs at `factor` of its speed for `duration`), syncer-crash (SIGKILL, restarted on its state after
    `duration`), partition (the learner's link drops everything for `duration`)."""
    target: str
    """A learner id, or "syncer"."""
    duration: float
    """How long the fault lasts."""
    factor: float = 1.0
    """Speed factor during a slow fault."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.at < 0 or self.duration <= 0:
            raise ValueError(f"fault {self.kind} at {self.at}s: times must be >= 0 and durations > 0")
        if not 0 < self.factor <= 1:
            raise ValueError(f"slow factor must be in (0, 1], got {self.factor}")
        if (self.kind == "syncer-crash") != (self.target == "syncer"):
            raise ValueError(f"fault {self.kind} cannot target {self.target!r}")


def preset(name: str, run_seconds: float, learners: list[str], seed: int = 0, mtbf: float | None = None) -> list[Fault]:
    """The faults of a named scenario for a run of `run_seconds` with these learners."""
    rng = random.Random(seed)
    d = run_seconds
    victim = rng.choice(learners)
    if name == "kill-one":
        return [Fault(0.3 * d, "kill", victim, 0.2 * d)]
    if name == "rolling-kills":  # each learner down once for about a fifth of the run, one after another
        gap = 0.75 * d / len(learners)
        return [Fault(0.1 * d + i * gap, "kill", lid, 0.2 * d) for i, lid in enumerate(learners)]
    if name == "hang":
        return [Fault(0.3 * d, "hang", victim, 0.2 * d)]
    if name == "straggler":
        return [Fault(0.2 * d, "slow", victim, 0.5 * d, factor=0.25)]
    if name == "syncer-crash":
        return [Fault(0.4 * d, "syncer-crash", "syncer", min(5.0, 0.05 * d))]
    if name == "partition":
        return [Fault(0.3 * d, "partition", victim, 0.15 * d)]
    if name == "random":
        mean = mtbf or d / 4
        faults, t = [], rng.expovariate(1 / mean)
        while t < 0.9 * d:
            kind = rng.choice(("kill", "hang"))
            faults.append(Fault(round(t, 3), kind, rng.choice(learners), round(min(rng.expovariate(10 / d), 0.3 * d) + 0.5, 3)))
            t += rng.expovariate(1 / mean)
        return faults
    raise ValueError(f"unknown chaos scenario {name!r}: choose one of {', '.join(PRESETS)} or give a JSON file")


def load(spec: str, run_seconds: float, learners: list[str], seed: int = 0, mtbf: float | None = None) -> list[Fault]:
    """A preset name, or the path of a JSON list of faults ({"at", "kind", "target", "duration"[, "factor"]})."""
    if spec in PRESETS:
        faults = preset(spec, run_seconds, learners, seed, mtbf)
    else:
        path = Path(spec)
        if not path.exists():
            raise ValueError(f"unknown chaos scenario {spec!r}: choose one of {', '.join(PRESETS)} or give a JSON file")
        try:
            faults = [Fault(**item) for item in json.loads(path.read_text())]
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"scenario file {path}: {e}; expected a JSON list of faults") from None
    for f in faults:
        if f.target != "syncer" and f.target not in learners:
            raise ValueError(f"fault {f.kind} at {f.at}s targets unknown learner {f.target!r}")
    return sorted(faults, key=lambda f: f.at)


def to_json(faults: list[Fault]) -> list[dict]:
    return [asdict(f) for f in faults]
