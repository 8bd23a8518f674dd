"""When a round of one fragment closes (docs/algorithm.md §4): a pure function of state, averages, now and config.

The syncer calls `decide` whenever something changes and again at the returned `wake_at`; nothing here reads a
clock or sleeps, so every rule is tested with plain numbers. A close at a deadline says when it became due
(`Decision.due_at`): the syncer acts on it as of then, however late it wakes up (syncer/core.py, `SyncerCore.poll`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    quorum: int
    """K: distinct learners a round needs before it may close — or every live learner, when fewer are live (a
    learner absent for absent_after_seconds, or gone, no longer holds the others' rounds)."""
    overlap: int
    """τ: steps a learner trains between pushing a fragment and applying the merged one."""
    grace: float | None = None
    """Fixed grace window in seconds after quorum; None selects the adaptive window."""
    gamma: float = 0.5
    """Share of the overlap's free time the adaptive window may use (γ < 1 keeps learners from stalling)."""
    cap_steps: float = 1.0
    """Upper bound of the adaptive window, in learner step times."""
    expect_steps: float = 0.0
    """Also keep a round open for live learners predicted to push its fragment within this many step times of
    the round's opening (0: the grace window alone decides)."""


@dataclass(frozen=True)
class Averages:
    """Moving averages in seconds; None until first measured."""

    step: float | None = None
    """ξ_step: a learner's inner-step time."""
    quorum: float | None = None
    """ξ_quorum: from a round's first contribution to its quorum."""
    sync: float | None = None
    """ξ_sync: receiving, merging and sending back one fragment."""


@dataclass(frozen=True)
class RoundState:
    contributors: frozenset[str]
    opened_at: float
    quorum_at: float | None = None


@dataclass(frozen=True)
class Decision:
    close: bool
    reason: str
    wake_at: float | None = None
    """When to ask again if nothing else happens (None: only when a contribution or liveness changes)."""
    quorum_at: float | None = None
    """When quorum was first reached (to be stored in the round state)."""
    due_at: float | None = None
    """For a close at a deadline (the grace window's end): that deadline, when the close became due. None for a close
    that holds whenever its inputs do (every live learner contributed): it became due when they came to hold."""


def grace_seconds(avg: Averages, cfg: PolicyConfig) -> float:
    """grace = clip(γ·slack, 0, cap) with slack = τ·ξ_step − (ξ_quorum + ξ_sync); 0 until ξ_step is known."""
    if cfg.grace is not None:
        return max(0.0, cfg.grace)
    if avg.step is None:
        return 0.0
    slack = cfg.overlap * avg.step - ((avg.quorum or 0.0) + (avg.sync or 0.0))
    return min(max(cfg.gamma * slack, 0.0), cfg.cap_steps * avg.step)


def expected_until(state: RoundState, live: frozenset[str], avg: Averages, cfg: PolicyConfig,
                   expected: Mapping[str, float]) -> float | None:
    """Latest predicted push, plus half a step of margin, of the live learners missing from the round whose
    push is predicted within `expect_steps` step times of its opening; None when there are none.

    Learners of equal speed drift a few steps apart (shared hosts, jitter), which a grace window of one step
    cannot bridge; their pushes of the same fragment are nevertheless seconds apart and predictable.
    """
    if not cfg.expect_steps or avg.step is None:
        return None
    horizon = state.opened_at + cfg.expect_steps * avg.step
    soon = [at for who, at in expected.items() if who in live and who not in state.contributors and at <= horizon]
    return max(soon) + 0.5 * avg.step if soon else None


def decide(state: RoundState, live: frozenset[str], avg: Averages, now: float, cfg: PolicyConfig,
           expected: Mapping[str, float] | None = None) -> Decision:
    """Close now, or say until when to wait. `expected` maps learners to the time their push of this fragment
    is predicted (see `expected_until`)."""
    count = len(state.contributors)
    if count == 0:
        return Decision(False, "empty")
    quorum_at = state.quorum_at if state.quorum_at is not None else now
    if live <= state.contributors:  # also below K: a quorum cannot count learners that are gone (absent or left)
        return Decision(True, "every live learner contributed", quorum_at=quorum_at)
    if count < cfg.quorum:
        return Decision(False, f"waiting for quorum ({count}/{cfg.quorum})")
    deadline = quorum_at + grace_seconds(avg, cfg)
    awaited = expected_until(state, live, avg, cfg, expected or {})
    if awaited is not None and awaited > deadline:
        deadline = awaited
    if now >= deadline:
        return Decision(True, "grace window ended", quorum_at=quorum_at, due_at=deadline)
    return Decision(False, "grace window open", wake_at=deadline, quorum_at=quorum_at)


class MovingAverage:
    """Exponential moving average that starts at the first sample."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample
        return self.value
