"""Where each learner is in the push schedule, as the syncer sees it: the basis of predicted pushes (rounds stay
open for them) and of phase leads (learners keep their schedules in step). Pure functions of the ledger."""

from __future__ import annotations

from collections.abc import Iterable

from diloco.algorithm.schedule import offset
from diloco.syncer.ledger import LearnerRecord

SIMILAR_SPEED = 1.5
"""Learners whose step times differ by less than this factor are peers; slower ones keep their own phase."""


def position(record: LearnerRecord, now: float, H: int, P: int) -> float | None:
    """Where the learner is in the push schedule now, in steps modulo H: the offset of its last push plus the
    steps since (docs/algorithm.md §2). None when unknown or when it has stopped pushing (hung, or left)."""
    if record.last_push is None or not record.step_time.value:
        return None
    at, last = record.last_push
    steps = (now - at) / record.step_time.value
    if steps > 2 * H / P + 1:
        return None
    return (offset(last, H, P) + steps) % H


def phase_lead(record: LearnerRecord, peers: Iterable[LearnerRecord], now: float, H: int, P: int) -> float | None:
    """Steps by which `record`'s schedule runs ahead of its reference's (negative: behind), circular over H; None
    when unknown or when it is the reference. The reference is the peer of similar speed whose session began first
    (`peers`: the live learners): it never moves, so a learner that rejoins at a random phase moves to the others.
    Every heartbeat asks, so a peer's position is worked out only when it began before the best found so far."""
    own = position(record, now, H, P)
    if own is None:
        return None
    reference, at = record, own
    for peer in peers:
        if (peer.joined_at, peer.id) >= (reference.joined_at, reference.id) or not peer.step_time.value:
            continue
        if 1 / SIMILAR_SPEED <= peer.step_time.value / record.step_time.value <= SIMILAR_SPEED:
            peer_at = position(peer, now, H, P)
            if peer_at is not None:
                reference, at = peer, peer_at
    if reference is record:
        return None
    return (own - at + H / 2) % H - H / 2


def predicted_push(record: LearnerRecord, fragment: int, now: float, H: int, P: int) -> float | None:
    """When `record`'s learner should next push `fragment`, from its position in the schedule and step time.
    A push up to a step overdue is still expected (the time is then in the past): pushes come a little late."""
    at = position(record, now, H, P)
    if at is None:
        return None
    steps = (offset(fragment, H, P) - at + 1) % H - 1
    return now + steps * record.step_time.value
