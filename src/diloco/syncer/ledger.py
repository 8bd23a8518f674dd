"""Per-learner bookkeeping on the syncer: liveness, progress and the tokens each learner got merged."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.policy import MovingAverage


@dataclass
class LearnerRecord:
    id: str
    session: str
    joined_at: float
    """When its current session began (its latest join)."""
    last_seen: float
    left: bool = False
    left_at: float | None = None
    """When it last left the run on its own (a leave, not an absence); None while it is in it."""
    step: int = 0
    tokens_trained: int = 0
    tokens_merged: float = 0.0
    """Σ tokens of this learner's merged contributions, divided by P (each token trains every fragment)."""
    data_position: int = 0
    """Data position of this learner's latest merged contribution: where a rejoining learner resumes, so no data
    is read twice. Fragments whose own last merge came earlier lose that bit of progress (under one period)."""
    loss: float | None = None
    tokens_per_second: float | None = None
    pushes: int = 0
    merged: int = 0
    refused: int = 0
    applied: int = 0
    speed: float | None = None
    step_time: MovingAverage = field(default_factory=MovingAverage)
    contribution_tokens: MovingAverage = field(default_factory=MovingAverage)
    """Typical tokens per merged contribution: how much a round misses when this learner is not in it."""
    staleness: int = 0
    """Versions its latest accepted contribution was behind the fragment it was merged into."""
    last_push: tuple[float, int] | None = None
    """(clock time, fragment) of its latest push: its phase in the push schedule."""
    start_position: int | None = None
    """Where its push schedule starts in a synchronous mode, set at join (SyncerCore._start_position)."""
    versions: dict[int, int] = field(default_factory=dict)
    """Per fragment, the version v of the published values P_v this learner holds: downlink changes start there.
    Not saved: after a restart every learner gets full values once (it may have missed what was being sent)."""
    merged_seq: dict[str, int] = field(default_factory=dict)
    """Highest merged push sequence number per "session:fragment": a re-sent push is merged at most once."""

    SAVED = ("id", "session", "left", "step", "tokens_trained", "tokens_merged", "data_position", "loss",
             "tokens_per_second", "pushes", "merged", "refused", "applied", "speed", "merged_seq")

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.SAVED}
        out.update(step_time=self.step_time.value, contribution_tokens=self.contribution_tokens.value)
        return out

    @classmethod
    def from_json(cls, data: dict, now: float) -> "LearnerRecord":
        record = cls(data["id"], data["session"], now, now)
        for k in cls.SAVED:
            setattr(record, k, data[k])
        record.step_time.value, record.contribution_tokens.value = data["step_time"], data["contribution_tokens"]
        return record

    def summary(self, now: float, absent_after: float) -> dict:
        state = "left" if self.left else ("live" if now - self.last_seen <= absent_after else "absent")
        return {
            "id": self.id, "state": state, "step": self.step, "tokens": self.tokens_trained,
            "tokens_merged": self.tokens_merged, "data_position": self.data_position, "loss": self.loss,
            "tokens_per_second": self.tokens_per_second,
            "pushes": self.pushes, "merged": self.merged, "refused": self.refused, "applied": self.applied,
            "speed": self.speed, "step_seconds": self.step_time.value, "last_seen_ago": round(now - self.last_seen, 3),
            "staleness": self.staleness,
            "last_push_ago": None if self.last_push is None else round(now - self.last_push[0], 3),
        }
