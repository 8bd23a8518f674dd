"""What a push from a learner already in its fragment's open round does (`SyncConfig.repeat_push`), in one place.

- **close** (the default): the open round is closed first, with the earlier contribution in it, and the new push
  opens the next round. Nothing per learner is kept: the round's sums hold every contribution.
- **replace** (the published algorithm): the new push takes the earlier one's place in the round. Each
  contributor's decoded Δ is kept in fp32 so that the sums can be made anew without the one replaced (folding it
  out would subtract float sums), and a re-sent push older than the one that replaced it is ignored: taking it back
  in would count the progress both carry twice. Memory: up to one fragment per contributor of an open round
  (docs/architecture.md, Syncer memory)."""

from __future__ import annotations

import torch

from diloco.algorithm.merge import StreamingMerge


class Close:
    """`repeat_push` close."""

    name = "close"

    def superseded(self, pending, session: str, seq: int) -> bool:
        """Whether a push (`session`, `seq`) is one a newer push of its session already replaced in the round."""
        return False

    def replaced(self, fs, learner_id: str):
        """The learner's contribution this push replaces in the open round (None: it replaces nothing)."""
        return None

    def fold(self, buffers, fs, method: str, learner_id: str, delta: torch.Tensor, weight: float,
             norms: list[float] | None, payload, replaces: bool) -> None:
        """Fold the admitted `delta` into the round's sums (`fs.merging`); its buffer goes back to `buffers` unless
        the round took it over."""
        fs.merging.add(delta, weight, norms, payload)
        if fs.merging.sum is not delta:
            buffers.give(delta)  # folded in, or kept encoded as the round's first: free for the next push


class Replace(Close):
    """`repeat_push` replace."""

    name = "replace"

    def superseded(self, pending, session: str, seq: int) -> bool:
        return pending is not None and pending.session == session and seq < pending.seq

    def replaced(self, fs, learner_id: str):
        return fs.pending.get(learner_id)

    def fold(self, buffers, fs, method, learner_id, delta, weight, norms, payload, replaces) -> None:
        """Keep `delta` as the learner's Δ in the round (its earlier one's buffer goes back) and fold a copy of it
        into the sums; when it `replaces` an earlier push, the sums are made anew from every kept Δ."""
        earlier = fs.kept.get(learner_id)
        fs.kept[learner_id] = (delta, weight, norms)
        if earlier is not None:
            buffers.give(earlier[0])
        if not replaces:
            fold_copy(buffers, fs.merging, delta, weight, norms)
            return
        old = fs.merging
        fs.merging = StreamingMerge(old.segments, method, buffers, old.mean_fallback)
        buffers.give(old.sum)  # the running sums, made of copies (never a kept Δ)
        buffers.give(old.units)
        for kept, w, n in fs.kept.values():
            fold_copy(buffers, fs.merging, kept, w, n)


def fold_copy(buffers, merging: StreamingMerge, delta: torch.Tensor, weight: float, norms: list[float] | None) -> None:
    """Fold a copy of a kept Δ into `merging`, which may take the copy over as its running sum."""
    work = buffers.take(delta.numel())
    work.copy_(delta)
    merging.add(work, weight, norms)
    if merging.sum is not work:
        buffers.give(work)


POLICIES = {policy.name: policy for policy in (Close(), Replace())}


def policy(name: str) -> Close:
    """The policy named by `SyncConfig.repeat_push` (validated by config.validate)."""
    return POLICIES[name]
