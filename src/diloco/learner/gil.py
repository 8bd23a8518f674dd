"""Python's thread switch interval while learners run: their background threads hand the GIL back sooner."""

from __future__ import annotations

import sys
import threading

GIL_SWITCH_SECONDS = 0.0005
"""Python's thread switch interval while a learner runs (Python's default is 5 ms). The sender and receiver
threads run Python between their numpy and gRPC calls; the training thread, which needs the GIL between every two
torch ops, then waited up to a whole interval each time. GPT-2 124M on CPU, one training thread: step-time
overhead +7.0% with 5 ms, +4.8% with 0.5 ms (medians of three; benchmarks/LOG.md, "Learner overhead and memory")."""

_switch = {"learners": 0, "before": None}
_switch_lock = threading.Lock()


def lower_switch_interval(seconds: float) -> bool:
    """Lower the process's switch interval to `seconds` for as long as some learner holds it; True if held."""
    with _switch_lock:
        if _switch["learners"] == 0:
            if seconds >= sys.getswitchinterval():
                return False
            _switch["before"] = sys.getswitchinterval()
            sys.setswitchinterval(seconds)
        _switch["learners"] += 1
        return True


def restore_switch_interval() -> None:
    with _switch_lock:
        _switch["learners"] -= 1
        if _switch["learners"] == 0:
            sys.setswitchinterval(_switch["before"])
