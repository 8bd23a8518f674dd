"""The phase lead every heartbeat carries, against its definition written out over all peers."""

import random

from diloco.syncer import phase
from diloco.syncer.ledger import LearnerRecord


def by_definition(record, peers, now, H, P):
    """The reference is the earliest-joined (then smallest id) of the learner and its peers of similar speed whose
    position is known; the lead is the learner's position against it, circular over H."""
    own = phase.position(record, now, H, P)
    if own is None:
        return None
    known = {record.id: (record, own)}
    for peer in peers:
        at = phase.position(peer, now, H, P)
        if at is not None and 1 / phase.SIMILAR_SPEED <= peer.step_time.value / record.step_time.value <= phase.SIMILAR_SPEED:
            known[peer.id] = (peer, at)
    reference = min(known, key=lambda i: (known[i][0].joined_at, i))
    return None if reference == record.id else (own - known[reference][1] + H / 2) % H - H / 2


def random_record(rng: random.Random, i: int, now: float, P: int) -> LearnerRecord:
    record = LearnerRecord(f"l{i}", "s", joined_at=float(rng.choice([0, 1, 2, 3])), last_seen=now)
    if rng.random() < 0.8:
        record.step_time.value = rng.choice([0.5, 1.0, 1.2, 2.0, 4.0])
    if rng.random() < 0.8:
        record.last_push = (now - rng.uniform(0, 10), rng.randrange(P))
    return record


def test_the_phase_lead_is_its_definition_over_all_peers():
    rng, now, H, P = random.Random(0), 100.0, 12, 6
    for _ in range(500):
        records = [random_record(rng, i, now, P) for i in range(rng.randint(1, 12))]
        for record in records:
            peers = [r for r in records if r is not record]
            assert phase.phase_lead(record, iter(peers), now, H, P) == by_definition(record, peers, now, H, P)
