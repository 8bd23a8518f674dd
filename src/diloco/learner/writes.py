"""How merged values are written into a fragment's tensors in place, on the training thread.

The fragment's tensors lie end to end in its flat values. A whole-values apply is one fused (foreach) operation per
arithmetic step over every tensor: on a GPU one or two kernel launches, not one per tensor. A kept-progress apply from
a staged Δ adds its gains a chunk at a time, so no fragment-sized fp32 vector is made.
"""

from __future__ import annotations

from typing import Iterable

import torch


def spans(tensors: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """`flat` cut into views shaped like `tensors`, which lie end to end in it (and fill it)."""
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


@torch.no_grad()
def write(tensors: list[torch.Tensor], values: torch.Tensor, taken: torch.Tensor | None = None,
          blend: float | None = None) -> None:
    """θ ← Θ (`values`); with `taken`, the values at the push: θ ← θ − θ at push + Θ, so that the steps taken since
    the push stay; with `blend`: θ ← blend·θ + (1 − blend)·Θ. Elementwise in that order, as tensor by tensor."""
    news = spans(tensors, values)
    if taken is not None:
        torch._foreach_sub_(tensors, spans(tensors, taken))
        torch._foreach_add_(tensors, news)
    elif blend is not None:
        for t in tensors:  # _foreach_mul_ rounds the scalar to a bf16 tensor's dtype first; mul_ does not
            t.mul_(blend)
        torch._foreach_add_(tensors, news, alpha=1 - blend)
    else:
        torch._foreach_copy_(tensors, news)


@torch.no_grad()
def add_gains(tensors: list[torch.Tensor], gains: Iterable[tuple[int, int, torch.Tensor]]) -> None:
    """θ += the gains, given as (lo, hi, values lo..hi of the fragment) a chunk at a time (staging.kept_progress)."""
    flats = [t.detach().view(-1) if t.is_contiguous() else torch.zeros(t.numel(), dtype=torch.float32,
                                                                         device=t.device) for t in tensors]
    ends = [0]
    for t in tensors:
        ends.append(ends[-1] + t.numel())
    first = 0
    for lo, hi, gain in gains:
        while ends[first + 1] <= lo:
            first += 1
        i = first
        while i < len(tensors) and ends[i] < hi:
            a, b = max(lo, ends[i]), min(hi, ends[i + 1])
            flats[i][a - ends[i] : b - ends[i]].add_(gain[a - lo : b - lo].to(flats[i].device))
            i += 1
    for t, flat in zip(tensors, flats):
        if not t.is_contiguous():  # its gain was gathered whole: a view of it is not one flat span
            t.add_(flat.view(t.shape))
