"""Closing the sessions of revoked credentials: an id removed from --credentials, or given a new token, loses its
session at once, and what it pushed into rounds still open is not merged.

The service decides which records its current credentials no longer vouch for (service.use_credentials); here the
core marks them. A revoked learner counts as gone (not live: no round waits for it), and every later call of its
session is refused (`Membership._record`). A contribution already folded into an open round's sums cannot be
taken out again (docs/architecture.md, Syncer memory), so that round is dropped when it closes: its other
contributors get the last good values back and push again.
"""

from __future__ import annotations

from typing import Callable

from diloco.exits import REVOKED
from diloco.syncer.ledger import LearnerRecord
from diloco.wire.bounds import shown


def revoked_message(learner_id: str) -> str:
    """What a revoked learner is told, on every call of its session."""
    return (f"the credential of learner {shown(learner_id)} {REVOKED} with the token this session was opened "
            f"with, so the session is closed; ask the syncer's operator for a new credential")


def revoke(core, vouched: Callable[[LearnerRecord], bool]) -> list[str]:
    """Revoke every learner of `core` (a SyncerCore) whose record `vouched` refuses; returns their ids. Core
    worker: it marks open rounds' sums as failed."""
    with core.lock:
        gone = [r for r in core.learners.values() if not r.revoked and not vouched(r)]
        for record in gone:
            record.revoked, record.left = True, True  # left_at stays: it did not leave on its own
        ids = {r.id for r in gone}
        for fs in core.fragments:
            held = sorted(ids & set(fs.pending))
            if held and fs.merging is not None and fs.merging.failed is None:
                fs.merging.failed = f"it holds a contribution of revoked learner(s) {', '.join(held)}"
    for record in gone:
        core.record_event("revoked", learner=record.id)
    return sorted(ids)
