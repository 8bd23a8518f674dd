"""Bounds on what learners send: every number that crosses the wire is checked here before the syncer uses it.

The protocol's integers are uint64 and its floats doubles, so a client can send 2^64 − 1 or NaN in any field. The
syncer's core computes with them (sums of tokens, moving averages of step times, replies that must fit uint64), so
the service checks each request against these bounds first and refuses the rest with INVALID_ARGUMENT and a message
naming the field. The bounds are far above anything a real learner reaches; they exist to keep the arithmetic sane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.config import WIRE_COMPRESSIONS as METHODS

MAX_COUNTER = 2**53
"""Largest step, token, sequence, version or position count accepted (exact in a double, ~9·10^15)."""
MAX_TOKENS_PER_STEP = 2**32
"""A push's tokens / steps: no learner trains 4·10^9 tokens in one inner step."""
MAX_TOKENS_PER_SECOND = 2**30
"""Heartbeat counters may grow at most this fast (~10^9 tokens/s, per learner) ..."""
MAX_STEPS_PER_SECOND = 2**16
"""... and steps this fast (65536 inner steps per second) ..."""
RATE_SLACK_SECONDS = 60.0
"""... plus this many seconds' worth, for clock jitter and a first report."""
MAX_ID_CHARS_SHOWN = 64
FLOAT_BOUNDS = {
    # field: (lowest, highest) accepted; a value outside (or NaN/inf) is dropped from the heartbeat
    "loss": (-1e9, 1e9),
    "step_seconds": (0.0, 1e6),
    "speed": (0.0, 1e6),
    "tokens_per_second": (0.0, 1e12),
}


class OutOfBounds(ValueError):
    """A request field outside what the syncer accepts; the message names the field and the bound."""


def shown(text: str, limit: int = MAX_ID_CHARS_SHOWN) -> str:
    """`text` for an error message: quoted, and cut short when long (a 20 KB id must not become a 20 KB status)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def check_counter(name: str, value: int, lowest: int = 0, highest: int = MAX_COUNTER) -> int:
    if not lowest <= value <= highest:
        raise OutOfBounds(f"{name} = {value} is out of bounds (must be in {lowest}..{highest})")
    return value


def check_push_header(header) -> None:
    """A PushHeader's counters: steps ≥ 1, tokens ≥ 1, every count ≤ 2^53, tokens per step ≤ 2^32."""
    for name in ("seq", "base_version", "data_position", "numel", "total_bytes"):
        check_counter(f"push {name}", getattr(header, name))
    check_counter("push steps", header.steps, lowest=1)
    check_counter("push tokens", header.tokens, lowest=1)
    if header.tokens > header.steps * MAX_TOKENS_PER_STEP:
        raise OutOfBounds(f"push of {header.tokens} tokens in {header.steps} steps is more than "
                          f"{MAX_TOKENS_PER_STEP} tokens per step")
    if header.compression not in ("", *METHODS):
        raise OutOfBounds(f"push compression {shown(header.compression)} is unknown: this syncer reads "
                          f"{', '.join(METHODS)}")


def check_fragment(fragment: int, fragments: int) -> int:
    if not 0 <= fragment < fragments:
        if fragments == 0:
            raise OutOfBounds(f"fragment {fragment}: the syncer has no model yet (join first)")
        raise OutOfBounds(f"fragment {fragment} is not in 0..{fragments - 1}")
    return fragment


@dataclass
class Sample:
    """A learner's last accepted heartbeat counters, and when (time.monotonic())."""

    step: int
    tokens: int
    at: float


def check_progress(step: int, tokens: int, previous: Sample | None, now: float) -> None:
    """Heartbeat counters: ≤ 2^53, and — when an earlier sample of this session is known — grown no faster than
    MAX_*_PER_SECOND since it (plus RATE_SLACK_SECONDS). A counter may go down (a restarted learner)."""
    check_counter("heartbeat step", step)
    check_counter("heartbeat tokens_trained", tokens)
    if previous is None:
        return
    elapsed = max(0.0, now - previous.at) + RATE_SLACK_SECONDS
    for name, value, before, rate in (("tokens_trained", tokens, previous.tokens, MAX_TOKENS_PER_SECOND),
                                      ("step", step, previous.step, MAX_STEPS_PER_SECOND)):
        if value > before + rate * elapsed:
            raise OutOfBounds(f"heartbeat {name} = {value} grew from {before} in {now - previous.at:.1f} s, faster "
                              f"than the syncer accepts ({rate} per second)")


def finite_fields(values: dict[str, float | None]) -> tuple[dict[str, float | None], list[str]]:
    """The heartbeat's float fields with non-finite or out-of-range ones set to None (not reported); and the names
    of those dropped, for the log."""
    out, dropped = {}, []
    for name, value in values.items():
        low, high = FLOAT_BOUNDS[name]
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            dropped.append(f"{name}={value!r}")
            value = None
        out[name] = value
    return out, dropped


def json_safe(value):
    """`value` (a status dict) for strict JSON: non-finite floats become None, and session ids are left out (they
    are the learners' credentials for Push, Heartbeat and Subscribe)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items() if "session" not in str(k).lower()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
