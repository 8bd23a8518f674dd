"""What the syncer sends back: each fragment's published values P_v (what every learner holding version v holds)
and a short window of encoded changes, so a learner one or a few versions behind gets the changes it missed and
one further behind gets full values. No per-learner copy of the model (docs/architecture.md, Syncer memory)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.algorithm import codec
from diloco.algorithm.codec import tensor_checksum
from diloco.syncer.ledger import LearnerRecord

WINDOW = 8
"""Most downlink changes kept per fragment; fewer when together they would be as large as full fp32 values."""


@dataclass(frozen=True)
class Publication:
    """One merged fragment on its way to one learner: full values, or the change from what it holds."""

    learner: str
    fragment: int
    version: int
    payload: codec.Encoded
    full: bool
    result_checksum: int
    """CRC-32 of the fp32 values the learner must hold after applying, so drift is caught, never trained on."""
    seq: int = 0
    """The push this answers; the learner ignores answers to pushes it no longer waits for. 0 for the first links of
    a chain of changes (and any other value it must hold without applying it), since learners number pushes from 1."""
    session: str = ""
    """`session_hash` of the learner's session it was computed for: after a re-join under the same id it is not
    delivered (the new session took full values at its join and does not hold what this change starts from)."""


def for_current_session(pub: Publication, record: LearnerRecord | None) -> bool:
    """Whether `pub` may still be delivered: not when its learner re-joined since it was computed (the new session
    holds the values of its join, not what the change starts from)."""
    return not pub.session or (record is not None and record.session_hash == pub.session)


def publish_change(fs, version: int, down_codec: str, theta: torch.Tensor) -> None:
    """P_v = P_{v−1} + decode(encode(Θ_v − P_{v−1})): the change every learner holding P_{v−1} applies, v being
    `version` (the fragment's next). `fs` is the fragment's FragmentState, `theta` Θ_v in fp32: with a bf16
    residual (`SyncConfig.bf16_residual`) a temporary, overwritten here to keep Θ_v − P_v as the residual."""
    change = codec.encode_difference(theta, fs.published, down_codec)
    codec.decode_add(change, fs.published)  # the same fp32 sum the learner's Receiver computes
    if fs.residual is not None:
        fs.residual.copy_(theta.sub_(fs.published))
    fs.checksum = (version, tensor_checksum(fs.published))
    fs.changes.append((version, change, fs.checksum[1]))
    # a chain is worth sending only while it is smaller than full values; older changes would never be sent
    full = codec.encoded_size(fs.fragment.numel, "fp32")
    while len(fs.changes) > WINDOW or (len(fs.changes) > 1 and sum(len(c.data) for _, c, _ in fs.changes) >= full):
        fs.changes.popleft()


def forget_held(fs, held: list[int]) -> None:
    """Drop the changes every live learner already holds (`held`: the versions they hold of this fragment): they
    would never be sent again, since a learner that returns after being absent, or joins, is sent what it misses
    from its own version or full values. With every learner answered each round the window is one change long."""
    floor = min(held, default=None)
    while fs.changes and floor is not None and fs.changes[0][0] <= floor:
        fs.changes.popleft()


def bound_changes(fragments, budget: float) -> int:
    """Drop changes until all `fragments`' windows together hold at most `budget` bytes: each time the oldest
    change of the fragment that keeps the most. A change is kept only for a live learner that lags behind on its
    fragment (`forget_held`); one that misses a dropped link gets full values instead, so the bound trades downlink
    bytes for memory that would otherwise fill up to about the model with many learners that lag (benchmarks/LOG.md,
    "A bound on the downlink changes"). Returns how many were dropped."""
    kept = [[fs, sum(len(c.data) for _, c, _ in fs.changes)] for fs in fragments]
    total, dropped = sum(size for _, size in kept), 0
    while total > budget:
        entry = max(kept, key=lambda e: e[1])
        fs = entry[0]
        if not fs.changes:
            break
        _, change, _ = fs.changes.popleft()
        entry[1] -= len(change.data)
        total -= len(change.data)
        dropped += 1
    return dropped


def count_full(tally: dict, publications) -> None:
    """Add the full-value answers among `publications` to `tally` ({"count", "bytes"}; the core's
    `full_answers`, under its lock)."""
    for pub in publications:
        if pub.full:
            tally["count"] += 1
            tally["bytes"] += len(pub.payload.data)


def checksum(fs) -> int:
    """CRC-32 of P_v, computed once per version."""
    if fs.checksum is None or fs.checksum[0] != fs.version:
        fs.checksum = (fs.version, tensor_checksum(fs.values))
    return fs.checksum[1]


def finished(record: LearnerRecord, index: int, final: bool, fragments, owns: Callable[[int], bool]) -> None:
    """Record whether `record`'s learner made its last push of fragment `index` (`final`: its training ended): it
    leaves without reading the fragment's results, so none is sent to it and what it held keeps no change alive
    (`held`). Its training ended, so it reads no result of any other fragment either: the `owns`-ed `fragments` where
    no push of it waits for an answer (`pending`) count as finished too, and what it held of them keeps no change
    while the others flush (a learner's finish applies the results it awaited, then pushes its last progress). A later
    push that is not its last takes a fragment back, and full values, since what it holds is unknown."""
    if final:
        idle = (j for j, fs in enumerate(fragments) if owns(j) and record.id not in fs.pending)
        for i in {index, *idle}:
            record.finished.add(i)
            record.versions.pop(i, None)
    else:
        record.finished.discard(index)


def held(record: LearnerRecord, index: int, fs) -> int | None:
    """The version of fragment `index` whose later changes `record`'s learner may still need: the one it holds, or
    the latest when it has finished the fragment; None when unknown."""
    return fs.version if index in record.finished else record.versions.get(index)


def publications(record: LearnerRecord, index: int, fs, seq: int, full: list[codec.Encoded]) -> list[Publication]:
    """What takes `record`'s learner from the version it holds to P_v: the changes it misses, in order, when they
    are all still kept (only the last answers `seq`), else full values (encoded once into `full`)."""
    held, v = record.versions.get(index), fs.version
    record.versions[index] = v
    chain = [link for link in fs.changes if held is not None and link[0] > held]
    if chain and chain[0][0] == held + 1:
        return [Publication(record.id, index, w, change, False, crc, seq if w == v else 0, record.session_hash)
                for w, change, crc in chain]
    if not full:
        full.append(codec.encode(fs.values, "fp32"))
    return [Publication(record.id, index, v, full[0], True, checksum(fs), seq, record.session_hash)]
