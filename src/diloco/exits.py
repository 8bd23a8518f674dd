"""Exit codes of `diloco learner` and `diloco syncer`: what a scheduler (SLURM, Ray, Kubernetes) should do next.

| code | meaning | restart? |
|---|---|---|
| 0  | finished: the run's budget or duration is spent, `--max-steps` reached, or it left/stopped on SIGTERM | no |
| 1  | an unexpected error (a bug): a traceback is printed | at most a few times |
| 2  | usage: a bad flag, a missing file, a damaged state directory | no: a person must fix the call |
| 75 | retry me (EX_TEMPFAIL): the syncer is unreachable or the connection was lost, a port is in use, another syncer holds the state folder | yes |
| 78 | do not retry (EX_CONFIG): the syncer refused this learner (wrong token, model mismatch, bad id, TLS, a revoked credential) | no |
| 130 | stopped at once by a second signal | as the scheduler decided |

docs/deploy.md repeats the table with what each scheduler recipe does with every code.
"""

from __future__ import annotations

import os

FINISHED = 0
FAILED = 1
USAGE = 2
RETRY = 75
"""EX_TEMPFAIL (sysexits.h): a temporary failure, the same call may succeed later."""
REFUSED = 78
"""EX_CONFIG (sysexits.h): the configuration is wrong; the same call fails again."""
INTERRUPTED = 130

EXIT_FILE_ENV = "DILOCO_EXIT_FILE"
"""If set, the process writes its exit code there (torchrun reports every failed worker as its own exit code 1, so
a job script reads the leader's real code from this file)."""

REVOKED = "was revoked: the syncer's --credentials file no longer lists it"
"""What the syncer tells a learner whose credential it revoked (syncer/revocation.py)."""
_TEMPORARY = ("cannot reach the syncer", "lost the connection", "stalled", "is already live", "finish:",
              "incomplete join reply")


def for_syncer_error(message: str) -> int:
    """The exit code for a learner's SyncerError: whether retrying later can succeed. The syncer refusing this
    learner (token, model, id, certificates) cannot be cured by retrying; everything else is a lost link."""
    if REVOKED in message:  # first: it may come wrapped in `finish:`'s undelivered pushes
        return REFUSED
    if any(text in message for text in _TEMPORARY):
        return RETRY
    if "refused" in message or "TLS" in message or "certificate" in message or "invalid learner id" in message:
        return REFUSED
    return RETRY


def for_error(command: str, error: BaseException) -> int:
    """The exit code of `diloco <command>` ending with `error` (one printed line, no traceback)."""
    from diloco.learner.transport import SyncerError

    if isinstance(error, SyncerError):
        return for_syncer_error(str(error))
    from diloco.syncer.at_rest.folder_lock import FolderInUse

    if isinstance(error, FolderInUse) or isinstance(error, OSError) and "cannot listen on" in str(error):
        return RETRY  # the port or the folder may be freed (a previous syncer still shutting down)
    return USAGE


def record(code: int) -> int:
    """Write `code` to $DILOCO_EXIT_FILE when set (only the leader of a torchrun group: RANK 0), and return it."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        try:
            with open(path, "w") as f:
                f.write(f"{code}\n")
        except OSError:
            pass  # the exit code itself still tells the truth to whoever started this process directly
    return code
