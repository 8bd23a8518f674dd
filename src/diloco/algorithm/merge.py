"""Token-weighted merging of learners' outer gradients (docs/algorithm.md §4).

Embedding tensors use the weighted mean; all others radial-directional averaging (RDA): the merged direction is
the weighted mean of unit directions and the merged norm the weighted mean of norms, so nearly orthogonal
contributions from many learners do not shrink the step.
"""

from __future__ import annotations

import math

import torch

from diloco.algorithm.codec import decode, decoded_chunks

_EPS = 1e-12


def token_weight(tokens: int, steps: int, staleness: int = 0, staleness_decay: float = 0.0) -> float:
    """w = tokens² / steps (tokens processed × tokens per step), divided by (1 + λ·staleness)."""
    if steps <= 0 or tokens <= 0:
        return 0.0
    return tokens * tokens / steps / (1.0 + staleness_decay * staleness)


def weighted_mean(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w_m Δ_m / Σ w_m over the rows of `deltas`."""
    w = weights / weights.sum()
    return (w[:, None] * deltas).sum(dim=0)


def rda(deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Radial-directional average of the rows of `deltas`; falls back to the mean if directions cancel. Branch-free,
    so that on a GPU nothing waits for the device."""
    w = weights / weights.sum()
    norms = deltas.norm(dim=1)
    kept = norms > _EPS  # unit(0) = 0
    units = torch.where(kept[:, None], deltas / torch.where(kept, norms, torch.ones_like(norms))[:, None], 0.0)
    direction = (w[:, None] * units).sum(dim=0)
    length = direction.norm()
    merged = (w * norms).sum() * direction / torch.where(length > 1e-6, length, torch.ones_like(length))
    return torch.where(length > 1e-6, merged, weighted_mean(deltas, weights))


def merge(deltas: list[torch.Tensor], weights, segments: list[tuple[int, bool]], method: str = "rda") -> torch.Tensor:
    """Merge flat fragment deltas; `weights` a list of floats or a tensor; `segments` lists (elements, is-embedding)
    per tensor in payload order. On the deltas' device, and on a GPU without waiting for it.

    `method="mean"` uses the weighted mean for every tensor (synchronous DiLoCo's plain averaging).
    """
    if method not in ("rda", "mean"):
        raise ValueError(f"unknown merge method {method!r}; choose rda or mean")
    if not deltas:
        raise ValueError("nothing to merge")
    if len(deltas) == 1:
        return deltas[0].clone()  # both rules are the identity for one contribution; skip their rounding
    w = torch.as_tensor(weights, dtype=torch.float32, device=deltas[0].device)
    usable = (w >= 0).all() & (w.sum() > 0)
    w = torch.where(usable, w, torch.ones_like(w))  # no usable token counts: treat contributions equally
    stacked = torch.stack(deltas)
    out = torch.empty_like(deltas[0])
    offset = 0
    for numel, embedding in segments:
        part = stacked[:, offset : offset + numel]
        rule = weighted_mean if embedding or method == "mean" else rda
        out[offset : offset + numel] = rule(part, w)
        offset += numel
    return out


RESCALE_ABOVE = 2.0**20
"""A contribution weighing more than this multiple of the reference weight becomes the reference instead."""
CHUNK = 1 << 18
"""Values of a contribution folded into both running sums at a time: read once from memory, then from cache."""


def segment_norms(delta: torch.Tensor, segments: list[tuple[int, bool]]) -> list[float]:
    """‖Δ‖ of every tensor of a flat fragment (`segments` as for `merge`)."""
    out, offset = [], 0
    for numel, _ in segments:
        out.append(torch.linalg.vector_norm(delta[offset : offset + numel]).item())
        offset += numel
    return out


class StreamingMerge:
    """One open round's merge, kept as running sums so that no contribution's Δ is stored: the result equals
    `merge` over the same contributions up to float rounding (exactly for one contribution).

    Per tensor: Σ w·Δ (the weighted mean, and RDA's fallback), and on RDA tensors Σ w·unit(Δ) and Σ w·‖Δ‖.
    Weights are taken relative to the first positive one, so the sums stay at Δ's scale however large tokens²/steps
    grows. Until some weight is positive every contribution counts equally (as `merge` does when Σ w = 0); the
    first positive weight restarts the sums, which is exact since zero-weight contributions then count for nothing.

    Speed: a contribution is read once for its norms (which the caller may pass in) and once more for both sums,
    a cache-sized chunk at a time; the first contribution becomes the running sum without a copy. Memory: given the
    payload it was decoded from, the first contribution is kept encoded (int4: an eighth of its fp32 size) and
    decoded again only when the round closes, or, without the mean fallback, a chunk at a time into the second
    contribution's buffer, which becomes the round's one sum; a round waiting for its second contributor, the common
    case, then holds almost nothing, and one with two holds one fragment-sized buffer, not two.

    `mean_fallback=False` (ours, `SyncConfig.rda_mean_fallback`): RDA tensors keep Σ w·unit(Δ) alone, in the one
    running sum, and a tensor whose mean direction vanishes merges to 0 (unit(0) = 0) instead of the weighted mean.
    Half the memory of an open round, and three memory streams per contribution instead of five.
    """

    def __init__(self, segments: list[tuple[int, bool]], method: str = "rda", buffers=None,
                 mean_fallback: bool = True):
        """`buffers`: where RDA's second running sum comes from and returns to (`syncer.buffers.Buffers`)."""
        if method not in ("rda", "mean"):
            raise ValueError(f"unknown merge method {method!r}; choose rda or mean")
        self.buffers = buffers
        self.segments = segments
        self.rda = [method == "rda" and not embedding for _, embedding in segments]
        self.mean_fallback = mean_fallback
        self.in_place = False
        """Without the mean fallback, once a second contribution came: RDA tensors' part of `sum` is Σ r·unit(Δ)."""
        self.vanished = 0
        """RDA tensors whose mean direction vanished in `result` (merged as the mean, or as 0 without the fallback)."""
        self.failed: str | None = None
        """Why folding a contribution in failed (its caller sets it): the round's sums are not to be published."""
        self.count = 0
        self.base = 0.0
        """The weight others are taken relative to; 0 while no weight was positive."""
        self.total = 0.0
        self.sum: torch.Tensor | None = None
        self.units: torch.Tensor | None = None
        """Σ r·unit(Δ) on RDA tensors (other tensors' part of it is unused); made when a second contribution comes."""
        self.norms: list[float] = []
        self._first_norms: list[float] | None = None
        self._first_payload = None
        """The first contribution, still encoded (`sum` is None meanwhile)."""

    @property
    def empty(self) -> bool:
        return self.sum is None and self._first_payload is None

    def add(self, delta: torch.Tensor, weight: float, norms: list[float] | None = None, payload=None) -> None:
        """Fold in one contribution; `delta` is taken over (not copied) when it is the first, unless `payload`, the
        `codec.Encoded` it was decoded from, is smaller: then that is kept instead, and `delta` is the caller's
        again (`sum is not delta`). `norms`: its `segment_norms`, if the caller has them already."""
        self.count += 1
        if weight > 0 and self.base == 0.0:
            self.base = weight
            self.sum, self.units, self.total = None, None, 0.0  # zero-weight contributions so far count for nothing
            self.in_place, self._first_payload = False, None
        r = weight / self.base if self.base else 1.0
        if r > RESCALE_ABOVE:
            self._rescale(self.base / weight)
            r = 1.0
        if r == 0.0 or not math.isfinite(r):
            return
        if self.empty:  # kept as it is: one contribution merges to itself, with no rounding
            if payload is not None and payload.codec != "fp32":
                self._first_payload, self.total, self._first_norms = payload, r, norms
            else:
                self.sum, self.total, self._first_norms = delta, r, norms
            return
        if any(self.rda) and norms is None:
            norms = segment_norms(delta, self.segments)
        if self._first_payload is not None and not self.mean_fallback:
            self._second_in_place(delta, r, norms)
            return
        self._decode_first()
        if not self.mean_fallback:
            self._add_in_place(delta, r, norms)
            return
        if self.units is None and any(self.rda):
            self._start_units()
        self.total += r
        offset = 0
        for s, (numel, _) in enumerate(self.segments):
            part = delta[offset : offset + numel]
            if not self.rda[s]:
                self.sum[offset : offset + numel].add_(part, alpha=r)
            else:
                unit_scale = r / norms[s] if norms[s] > _EPS else 0.0  # unit(0) = 0
                self.norms[s] += r * norms[s] if unit_scale else 0.0
                for lo in range(0, numel, CHUNK):
                    chunk, at = part[lo : lo + CHUNK], offset + lo
                    self.sum[at : at + chunk.numel()].add_(chunk, alpha=r)
                    if unit_scale:
                        self.units[at : at + chunk.numel()].add_(chunk, alpha=unit_scale)
            offset += numel

    def _rescale(self, factor: float) -> None:
        """Make a much heavier newcomer the reference weight: every sum so far times `factor` (< 1), so relative
        weights stay ≤ RESCALE_ABOVE and no declared counter can overflow the sums (a weight 10^38 times the
        first one would turn them to inf)."""
        self.base /= factor
        self.total *= factor
        self.norms = [n * factor for n in self.norms]
        if self.sum is not None:
            self.sum.mul_(factor)
        if self.units is not None:
            self.units.mul_(factor)
        # a first contribution still encoded is scaled by `total` when it is decoded

    def _decode_first(self) -> None:
        """The first contribution as the running sum, decoded again from its payload if it was kept encoded."""
        if self._first_payload is None:
            return
        numel = self._first_payload.numel
        self.sum = self.buffers.take(numel) if self.buffers is not None else torch.empty(numel)
        decode(self._first_payload, self.sum)
        self._first_payload = None
        if self.total != 1.0:  # rescaled while encoded (`_rescale`): the sum is total·Δ
            self.sum.mul_(self.total)

    def _second_in_place(self, delta: torch.Tensor, r: float, norms: list[float]) -> None:
        """The second contribution while the first is still encoded: `delta` becomes the one running sum (r·unit(Δ)
        on RDA tensors, r·Δ on the others) and the first is added into it as it is decoded, a chunk at a time. One
        fragment-sized buffer for the round instead of two (the first's decode beside the second's)."""
        first, r1 = self._first_payload, self.total
        first_norms = self._first_norms or self._payload_norms(first)
        self._first_payload, self.norms, scales = None, [0.0] * len(self.segments), []
        offset = 0
        for s, (numel, _) in enumerate(self.segments):
            part = delta[offset : offset + numel]
            offset += numel
            if not self.rda[s]:
                part.mul_(r)
                scales.append(r1)
                continue
            second, first_norm = norms[s] if norms[s] > _EPS else 0.0, first_norms[s] if first_norms[s] > _EPS else 0.0
            part.mul_(r / second) if second else part.zero_()  # unit(0) = 0
            self.norms[s] = r * second + r1 * first_norm
            scales.append(r1 / first_norm if first_norm else 0.0)
        for lo, hi, chunk in decoded_chunks(first):
            for s, start, end in self._spans(lo, hi):
                if scales[s]:
                    delta[start:end].add_(chunk[start - lo : end - lo], alpha=scales[s])
        self.sum, self.total, self.in_place = delta, r1 + r, True

    def _spans(self, lo: int, hi: int):
        """(tensor, start, end) of each tensor's part of values lo..hi."""
        offset = 0
        for s, (numel, _) in enumerate(self.segments):
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                yield s, start, end
            offset += numel

    def _payload_norms(self, payload) -> list[float]:
        """`segment_norms` of an encoded contribution, read a chunk at a time."""
        squares = [0.0] * len(self.segments)
        for lo, hi, chunk in decoded_chunks(payload):
            for s, start, end in self._spans(lo, hi):
                squares[s] += float(chunk[start - lo : end - lo].double().square().sum())
        return [q ** 0.5 for q in squares]

    def _add_in_place(self, delta: torch.Tensor, r: float, norms: list[float]) -> None:
        """One running sum: Σ r·unit(Δ) on RDA tensors, Σ r·Δ on the others (no mean fallback)."""
        if not self.in_place:
            self.norms = self._units_of_first(self.sum)
            self.in_place = True
        self.total += r
        offset = 0
        for s, (numel, _) in enumerate(self.segments):
            part, acc = delta[offset : offset + numel], self.sum[offset : offset + numel]
            if not self.rda[s]:
                acc.add_(part, alpha=r)
            elif norms[s] > _EPS:  # unit(0) = 0
                acc.add_(part, alpha=r / norms[s])
                self.norms[s] += r * norms[s]
            offset += numel

    def _units_of_first(self, out: torch.Tensor) -> list[float]:
        """Write Σ r·unit(Δ) of the first contribution (whose sum is r·Δ, r = total) into `out`'s RDA tensors;
        returns Σ r·‖Δ‖ per tensor (0 on the others)."""
        first = self._first_norms or segment_norms(self.sum, self.segments)
        norms = [0.0] * len(self.segments)
        offset = 0
        for s, (numel, _) in enumerate(self.segments):
            if self.rda[s]:
                units = out[offset : offset + numel]
                norm = first[s] * self.total  # ‖r·Δ‖
                if norm > _EPS:
                    torch.mul(self.sum[offset : offset + numel], self.total / norm, out=units)
                    norms[s] = norm
                else:
                    units.zero_()
            offset += numel
        return norms

    def _start_units(self) -> None:
        """Σ r·unit(Δ) of the first contribution in a second sum, written without zero-filling."""
        numel = self.sum.numel()
        self.units = self.buffers.take(numel) if self.buffers is not None else torch.empty(numel, dtype=self.sum.dtype)
        self.norms = self._units_of_first(self.units)

    def result(self) -> torch.Tensor:
        """The merged Δ (the running sums are reused for it: call once)."""
        self._decode_first()
        if self.sum is None:
            raise ValueError("nothing to merge")
        out, offset = self.sum, 0
        units = self.sum if self.in_place else self.units
        for s, (numel, _) in enumerate(self.segments):
            part = out[offset : offset + numel]
            if units is not None and self.rda[s]:
                direction = units[offset : offset + numel]  # total × the mean unit direction
                length = torch.linalg.vector_norm(direction).item() / self.total
                if length > 1e-6:
                    torch.mul(direction, self.norms[s] / self.total / (length * self.total), out=part)
                    offset += numel
                    continue
                self.vanished += 1  # the mean direction vanished: the weighted mean, or 0 without it
                if self.in_place:
                    part.zero_()
                    offset += numel
                    continue
            part.div_(self.total)  # exact for one contribution (÷ 1)
            offset += numel
        if self.buffers is not None:
            self.buffers.give(self.units)
        self.units = None
        return out
