"""When each fragment is pushed (docs/algorithm.md §2): fragment p is due after inner step t when (t - o_p) mod H = 0."""

from __future__ import annotations


def offset(fragment: int, sync_every: int, num_fragments: int) -> int:
    """o_p = floor(p * H / P): spreads the P fragments evenly over the H-step period."""
    return fragment * sync_every // num_fragments


def due(step: int, sync_every: int, num_fragments: int) -> list[int]:
    """Fragments to push after local inner step `step` (1-based)."""
    return [
        p for p in range(num_fragments) if step >= 1 and (step - offset(p, sync_every, num_fragments)) % sync_every == 0
    ]


def leading_position(positions: list[int | None], sync_every: int) -> int | None:
    """Of schedule positions (1..H, circular) reported by syncer shards, the one at or ahead of all others: each
    shard saw its own fragments' pushes, and together the shards' latest is the most advanced. Peers stay within
    half a period of each other, so "ahead" is well defined; None when no shard gave one."""
    known = [p for p in positions if p is not None]
    for candidate in known:
        if all((candidate - p) % sync_every <= sync_every // 2 for p in known):
            return candidate
    return known[0] if known else None
