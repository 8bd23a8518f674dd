"""The simulated world: how chips fail, what recovering costs, and how training is paced.

Every constant of the goodput simulator lives in these two dataclasses; presets.py fills them in and says
where each value comes from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

YEAR_SECONDS = 365.0 * 86400.0


@dataclass(frozen=True)
class FailureModel:
    """The failure process and what each kind of recovery costs."""

    mtbi_seconds: float = YEAR_SECONDS
    """Mean time between interruptions of one chip. Chips fail independently (Poisson), so a group of c
    running chips fails at rate c / mtbi_seconds."""

    slice_chips: int = 256
    """Chips that fail together: one interruption takes a whole slice out until it is repaired. Also the
    granularity by which an elastic job shrinks and grows."""

    repair_seconds: float = 900.0
    """Time from a slice's failure until it (or a spare in its place) is healthy and can rejoin."""

    shrink_seconds: float = 18.0
    """Elastic job: pause from a failure until the job computes again without the lost slice (detection
    plus rebuilding the mesh and collectives around it)."""

    grow_seconds: float = 14.0
    """Elastic job: pause to add repaired slices back (rebuilding the mesh and collectives with them)."""

    grow_wait_seconds: float = 30.0
    """How long a repaired slice waits to be taken back. Growing is optional, so the job waits this long for
    a shrink it must do anyway (which takes the slice back at no extra cost) before pausing just to grow."""

    restart_seconds: float = 47.0
    """Non-elastic job: time from a failure until it computes again (detection, rescheduling onto the healthy
    slices, process start, loading the last checkpoint). Work since that checkpoint is lost as well."""

    planned_restart_seconds: float = 23.0
    """Non-elastic job: restart to take repaired slices back, after writing a checkpoint (no detection, no
    rescheduling, no work lost)."""

    checkpoint_seconds: float = 0.5
    """Non-elastic job: stall to write one checkpoint."""

    checkpoint_interval_seconds: float | None = None
    """Non-elastic job: compute time between checkpoints; None picks the Young/Daly optimum from the job's
    mean time between failures."""

    failures_in_pauses: bool = False
    """Whether chips can fail while their unit is paused or restarting. Off: only failures that strike a
    running unit count (how the published figures are reproduced)."""

    def validate(self) -> None:
        _check_numbers(self, allow_infinite=("mtbi_seconds",))
        for name in ("mtbi_seconds", "slice_chips"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("repair_seconds", "shrink_seconds", "grow_seconds", "grow_wait_seconds",
                     "restart_seconds", "planned_restart_seconds", "checkpoint_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.checkpoint_interval_seconds is not None and not self.checkpoint_interval_seconds > 0:
            raise ValueError("checkpoint_interval_seconds must be positive")


@dataclass(frozen=True)
class TrainingModel:
    """How training is paced: the step, the synchronisation cadence and the learners' speed noise."""

    step_seconds: float = 1.0
    """Healthy time of one inner step."""

    sync_every: int = 24
    """H: inner steps between two synchronisations of the same parameters (whole model for synchronous
    DiLoCo, one fragment for Decoupled DiLoCo)."""

    fragments: int = 24
    """P: fragments of Decoupled DiLoCo; P / H fragment rounds close per step."""

    overlap_steps: int = 2
    """tau: steps a Decoupled DiLoCo learner keeps computing after a push before it wants the merged result."""

    quorum: int = 1
    """K: learners a Decoupled DiLoCo round needs; the global model advances only while K learners compute."""

    grace_seconds: float | None = None
    """Decoupled DiLoCo grace window after quorum. None is the adaptive window, capped by the overlap slack,
    which never stalls a learner; a fixed window stalls each round by what exceeds overlap_steps steps."""

    diloco_sync_seconds: float = 1.0
    """Synchronous DiLoCo: blocking time of one outer step (all-reduce of the whole model between learners)."""

    step_time_cv: float = 0.10
    """Coefficient of variation of one inner step's time on a learner, independent between steps and learners.
    Only synchronous DiLoCo pays for it: its outer step waits for the slowest learner."""

    def validate(self) -> None:
        _check_numbers(self)
        if not self.step_seconds > 0:
            raise ValueError("step_seconds must be positive")
        for name in ("sync_every", "fragments", "quorum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("overlap_steps", "diloco_sync_seconds", "step_time_cv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.grace_seconds is not None and self.grace_seconds < 0:
            raise ValueError("grace_seconds must not be negative")

    def grace_stall_per_step(self) -> float:
        """Seconds a learner stalls per step because a fixed grace window outlasts the overlap."""
        if self.grace_seconds is None:
            return 0.0
        excess = max(0.0, self.grace_seconds - self.overlap_steps * self.step_seconds)
        return excess * self.fragments / self.sync_every


def _check_numbers(obj, allow_infinite: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and f.name not in allow_infinite)):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


def young_daly_interval(checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0) -> float:
    """Daly's higher-order estimate of the optimal compute time between checkpoints (Young's sqrt(2*d*M) to
    first order)."""
    d, m = checkpoint_seconds, mtbf_seconds + restart_seconds
    if d <= 0:
        return math.inf
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def override(obj, assignments: dict[str, str]):
    """A copy of a dataclass with some fields replaced from strings (for `--set NAME=VALUE`)."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    changes = {}
    for name, text in assignments.items():
        if name not in fields:
            continue
        current = getattr(obj, name)
        try:
            changes[name] = _parse_like(current, fields[name].type, text)
        except ValueError:
            raise ValueError(f"{name}: cannot use {text!r}") from None
    return dataclasses.replace(obj, **changes)


def _parse_like(current, annotation, text: str):
    if text.lower() in ("none", "adaptive", "auto") and "None" in str(annotation):
        return None
    if isinstance(current, bool) or annotation in (bool, "bool"):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(current, int) and "int" in str(annotation):
        return int(text)
    return float(text)


def field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(FailureModel)} | {f.name for f in dataclasses.fields(TrainingModel)}
