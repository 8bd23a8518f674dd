"""The few lines a framework callback says in a run (joined, resumed from step N, the budget is spent: stopping,
left) reach stderr even where the application configured no logging: Python would drop them there (INFO lines), and
a user would not see why their Trainer stopped. Where logging is configured (a handler on the root logger or on
`diloco`'s: `diloco`'s command line configures the root) they go there alone, never twice."""

from __future__ import annotations

import logging
import sys

NAME = "diloco.integrations"


class _Stderr(logging.StreamHandler):
    """sys.stderr as it is at each line (a notebook or a test may replace it after this handler was made)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


_HANDLER = _Stderr()
_HANDLER.setFormatter(logging.Formatter("diloco: %(message)s"))
_set_level = False
"""Whether `diloco`'s level is INFO because the handler was added (and goes back to unset with it)."""


def logger() -> logging.Logger:
    """The integrations' logger, its lines shown: while neither the root logger nor `diloco`'s has a handler of the
    application's, `diloco`'s has one to stderr at INFO; once the application configures logging, it is taken away."""
    global _set_level
    top = logging.getLogger("diloco")
    ours = _HANDLER in top.handlers
    configured = bool(logging.getLogger().handlers) or any(h is not _HANDLER for h in top.handlers)
    if configured and ours:
        top.removeHandler(_HANDLER)
        if _set_level:
            top.setLevel(logging.NOTSET)
            _set_level = False
    elif not configured and not ours:
        top.addHandler(_HANDLER)
        if top.level == logging.NOTSET:
            top.setLevel(logging.INFO)
            _set_level = True
    return logging.getLogger(NAME)
