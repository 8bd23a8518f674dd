"""Refused joins, told to the operator: a log line naming the learner and why (the same reason at most once per
Throttled interval, with a count of those left out, so a client retrying in a loop cannot flood the log) and a count
by reason in /status `refusals`, beside the refused pushes'."""

from __future__ import annotations

import logging
import re

from diloco.syncer.observation.metrics import reason_label
from diloco.syncer.observation.throttle import Throttled
from diloco.wire.bounds import shown

PREFIX = "join: "
"""What a join refusal's reason starts with in /status `refusals` and on the tape (pushes' reasons have none)."""


def join_reason(details: str) -> str:
    """"join: " and the refusal's text up to its first ':', ';' or '(', without quoted values or numbers: "learner
    id 'a' is already live in this run (joined 3 s ago); ..." is "join: learner id is already live in this run"."""
    return PREFIX + reason_label(re.split(r"[:;(]", details, maxsplit=1)[0], limit=60)


class JoinRefusals:
    def __init__(self, logger: logging.Logger):
        self.lines = Throttled(logger, level=logging.WARNING)

    def log(self, learner_id: str, details: str) -> str:
        """Log a refused join (throttled by reason); returns its reason."""
        reason = join_reason(details)
        self.lines.error(reason, f"refused the join of learner {shown(learner_id)}: {details}")
        return reason
