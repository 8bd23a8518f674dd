"""Learner ids: what the syncer accepts, checked alike by learners (before they send one) and the syncer."""

from __future__ import annotations

import re

LEARNER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


class InvalidLearnerId(ValueError):
    """A learner id the syncer would refuse; the message quotes it (cut short) and says what an id may hold."""


def check_learner_id(learner_id: str) -> str:
    if not LEARNER_ID.fullmatch(learner_id):
        shown = repr(learner_id) if len(learner_id) <= 64 else f"{learner_id[:64]!r}… ({len(learner_id)} characters)"
        raise InvalidLearnerId(f"invalid learner id {shown}: {RULE}")
    return learner_id
