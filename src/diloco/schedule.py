"""When each fragment is pushed (DESIGN §3.2): fragment p is due after inner step t when (t - o_p) mod H = 0."""

from __future__ import annotations


def offset(fragment: int, sync_every: int, num_fragments: int) -> int:
    """o_p = floor(p * H / P): spreads the P fragments evenly over the H-step period."""
    return fragment * sync_every // num_fragments


def due(step: int, sync_every: int, num_fragments: int) -> list[int]:
    """Fragments to push after local inner step `step` (1-based)."""
    return [
        p for p in range(num_fragments) if step >= 1 and (step - offset(p, sync_every, num_fragments)) % sync_every == 0
    ]
