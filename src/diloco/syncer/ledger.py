"""Per-learner bookkeeping on the syncer: liveness, progress and the tokens each learner got merged."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.policy import MovingAverage


@dataclass
class LearnerRecord:
    id: str
    session: str
    joined_at: float
    last_seen: float
    left: bool = False
    step: int = 0
    tokens_trained: int = 0
    tokens_merged: float = 0.0
    """Σ tokens of this learner's merged contributions, divided by P (each token trains every fragment)."""
    data_position: int = 0
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
    held: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per fragment, the exact values this learner holds as its base: what downlink changes are taken against."""
    seen: set[tuple[str, int]] = field(default_factory=set)
    """(session, seq) of pushes already admitted, so a re-sent push is merged at most once."""

    def summary(self, now: float, absent_after: float) -> dict:
        state = "left" if self.left else ("live" if now - self.last_seen <= absent_after else "absent")
        return {
            "id": self.id, "state": state, "step": self.step, "tokens": self.tokens_trained,
            "tokens_merged": self.tokens_merged, "loss": self.loss, "tokens_per_second": self.tokens_per_second,
            "pushes": self.pushes, "merged": self.merged, "refused": self.refused, "applied": self.applied,
            "speed": self.speed, "step_seconds": self.step_time.value, "last_seen_ago": round(now - self.last_seen, 3),
        }
