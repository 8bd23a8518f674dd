"""What the syncer's memory holds, by part (docs/architecture.md, Syncer memory), for /status and /metrics.

The parts are the terms of the memory formula, counted from the tensors and encoded payloads the core and the
service hold at the moment of asking; beside them, what malloc has handed out that is in none of them (`other_heap`)
and what it keeps free for reuse (`allocator_free`). The process's RSS minus their sum is the interpreter's own
allocator, libraries and code."""

from __future__ import annotations

from pathlib import Path

from diloco.algorithm.codec import Encoded

PARTS = ("model", "outer_state", "changes", "open_rounds", "reused_buffers", "queued_answers", "sending",
         "serialized_updates", "receiving", "other_heap", "allocator_free")


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def core_parts(core) -> dict[str, int]:
    """Bytes of each part the core holds. Read without the worker's cooperation: a round closing meanwhile may
    be counted before or after, never in a way that raises."""
    parts = dict.fromkeys(PARTS, 0)
    for fs in list(core.fragments):
        parts["model"] += _nbytes(fs.theta) + _nbytes(fs.published) + _nbytes(fs.residual)
        parts["outer_state"] += _nbytes(fs.momentum) + _nbytes(fs.pending_delta)
        if fs.direction is not None:  # the direction test's reference (`SyncConfig.direction_floor`)
            parts["outer_state"] += _nbytes(fs.direction.reference)
        parts["changes"] += sum(len(change.data) for _, change, _ in list(fs.changes))
        merging = fs.merging
        payloads = {}  # the agreement test keeps each contribution's payload; the round's first may be among them
        if merging is not None:
            first = merging._first_payload
            parts["open_rounds"] += _nbytes(merging.sum) + _nbytes(merging.units)
            if first is not None:
                payloads[id(first)] = len(first.data)
        parts["open_rounds"] += sum(_nbytes(kept[0]) for kept in list(fs.kept.values()))  # --repeat-push replace
        for c in list(fs.pending.values()):  # the agreement test (`SyncConfig.agreement_floor`): sketches, payloads
            parts["open_rounds"] += _nbytes(c.sketch)
            if isinstance(c.encoded, Encoded):  # not one waiting on disk (syncer/kept_payloads.py)
                payloads[id(c.encoded)] = len(c.encoded.data)
        parts["open_rounds"] += sum(payloads.values())
        parts["outer_state"] += sum(_nbytes(sketch) for _, sketch in list(fs.agreement_peers.values()))
    parts["reused_buffers"] = core.buffers.kept_bytes
    return parts


def _distinct_bytes(payloads, seen: set[int]) -> int:
    """Bytes of the payloads whose ids are not in `seen`, each counted once (`seen` grows with them)."""
    total = 0
    for payload in payloads:
        if id(payload) not in seen:
            seen.add(id(payload))
            total += len(payload.data)
    return total


def queued_bytes(queues, kept: set[int]) -> int:
    """Bytes of the distinct payloads waiting in learners' update queues that the core no longer holds (full
    values, or changes that left the window); `kept`: ids of the payloads the core still keeps."""
    return _distinct_bytes((p for queue in list(queues) for p in queue.payloads()), set(kept))


def sending_bytes(payloads, queues, kept: set[int]) -> int:
    """Bytes of the distinct payloads update streams are sending now that neither a queue nor the core holds."""
    return _distinct_bytes(payloads, set(kept) | {id(p) for queue in list(queues) for p in queue.payloads()})


def with_heap(parts: dict[str, int], heap: tuple[int, int] | None) -> dict[str, int]:
    """`parts` and what malloc says beside them (`allocator.heap`): `other_heap`, what it has handed out that is in
    no part (gRPC's buffers, payloads being decoded, temporaries, the interpreter's large objects), and
    `allocator_free`, what it keeps for reuse. Both 0 where malloc cannot be asked."""
    in_use, free = heap or (0, 0)
    return {**parts, "other_heap": max(0, in_use - sum(parts.values())) if heap else 0, "allocator_free": free}


def kept_change_ids(core) -> set[int]:
    return {id(change) for fs in list(core.fragments) for _, change, _ in list(fs.changes)}


def rss_bytes() -> int:
    """This process's resident set now (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
