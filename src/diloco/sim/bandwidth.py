"""Compute utilisation as a function of link bandwidth, and the bandwidth each method needs.

Per step of healthy time t, on the link of one datacenter (learner):
- dp:        ring all-reduce of the gradients, 2(D-1)/D * N * bits, every step, hidden in the backward pass
             (a fraction f of the step): step time t + max(0, c - f*t), with c the transfer time.
- diloco:    ring all-reduce of the whole model's outer gradients every H steps, blocking.
- streaming: ring all-reduce of one fragment (N/P values) every H/P steps; the learner computes tau more
             steps before it needs the result: t + (P/H) * max(0, c - tau*t), and never less than the link's
             pace (P/H) * c.
- decoupled: one fragment (N/P values) one way to the syncer every H/P steps; learners never wait, so only
             the link's pace binds: max(t, (P/H) * c). Below it a learner keeps computing but its fragments
             fall behind the schedule; that shortfall is counted as lost utilisation so all methods share
             one axis.
Utilisation is t over the resulting time per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

METHODS = ("dp", "diloco", "streaming", "decoupled")

# Bits on the wire per value: int codecs carry one 16-bit scale per block of 128 values.
SCALE_BLOCK = 128
CODEC_BITS = {"fp32": 32.0, "bf16": 16.0, "int8": 8.0 + 16.0 / SCALE_BLOCK, "int4": 4.0 + 16.0 / SCALE_BLOCK}


@dataclass(frozen=True)
class Workload:
    """The model being trained and the sites it is spread over."""

    parameters: float = 5e9
    """N: model parameters."""

    step_seconds: float = 1.0
    """Healthy time of one inner step."""

    datacenters: int = 8
    """D: datacenters (one learner each) exchanging over the wide-area links."""

    backward_fraction: float = 2.0 / 3.0
    """Share of a step spent in the backward pass, which data-parallel training overlaps its all-reduce with."""

    def validate(self) -> None:
        if not self.parameters > 0 or not self.step_seconds > 0:
            raise ValueError("parameters and step_seconds must be positive")
        if self.datacenters < 1:
            raise ValueError("datacenters must be at least 1")
        if not 0 <= self.backward_fraction <= 1:
            raise ValueError("backward_fraction must be between 0 and 1")


@dataclass(frozen=True)
class Method:
    """How a training method synchronises."""

    kind: str
    """dp, diloco, streaming or decoupled."""

    codec: str
    """Wire format of each value: fp32, bf16, int8 or int4 (gradients for dp, outer gradients otherwise)."""

    fragments: int = 1
    """P: fragments the model is split into (1 = whole model)."""

    sync_every: int = 1
    """H: steps between two synchronisations of the same fragment."""

    overlap_steps: int = 0
    """tau: steps of compute that hide one fragment's transfer."""

    overhead: float = 1.0
    """Multiplier on the modelled volume (framing, both directions), e.g. calibrated from a real run."""

    def validate(self) -> None:
        if self.kind not in METHODS:
            raise ValueError(f"unknown method {self.kind!r}; choose from {', '.join(METHODS)}")
        if self.codec not in CODEC_BITS:
            raise ValueError(f"unknown codec {self.codec!r}; choose from {', '.join(CODEC_BITS)}")
        if self.fragments < 1 or self.sync_every < 1 or self.overlap_steps < 0:
            raise ValueError("fragments and sync_every must be at least 1, overlap_steps at least 0")


def default_method(kind: str, *, fragments: int = 24, sync_every: int = 24, overlap_steps: int = 2,
                   codec: str | None = None) -> Method:
    """The published configuration of each method (docs/algorithm.md §5): dp in bf16, DiLoCo on the whole model in
    bf16, Streaming and Decoupled DiLoCo with P fragments, overlap tau and int4."""
    if kind == "dp":
        return Method("dp", codec or "bf16")
    if kind == "diloco":
        return Method("diloco", codec or "bf16", 1, sync_every, 0)
    return Method(kind, codec or "int4", fragments, sync_every, overlap_steps)


def bits_per_sync(method: Method, work: Workload) -> float:
    """Bits one datacenter's link carries (each direction) for one synchronisation."""
    values = work.parameters / method.fragments
    bits = values * CODEC_BITS[method.codec] * method.overhead
    if method.kind == "decoupled":
        return bits  # one way to the syncer
    d = work.datacenters
    return 2.0 * (d - 1) / d * bits


def syncs_per_step(method: Method) -> float:
    return 1.0 if method.kind == "dp" else method.fragments / method.sync_every


def step_time(method: Method, work: Workload, gbps: float) -> float:
    """Time per step, communication included, on a link of `gbps` gigabits per second."""
    t = work.step_seconds
    if gbps <= 0:
        return math.inf
    c = bits_per_sync(method, work) / (gbps * 1e9)
    if method.kind == "dp":
        return t + max(0.0, c - work.backward_fraction * t)
    rate = syncs_per_step(method)
    if method.kind == "decoupled":
        return max(t, rate * c)
    return max(t + rate * max(0.0, c - method.overlap_steps * t), rate * c)


def utilisation(method: Method, work: Workload, gbps: float) -> float:
    return work.step_seconds / step_time(method, work, gbps)


def required_gbps(method: Method, work: Workload, target: float) -> float:
    """Smallest bandwidth (Gbps) at which utilisation reaches `target` (bisection; utilisation only grows with
    bandwidth)."""
    if not 0 < target <= 1:
        raise ValueError("target utilisation must be in (0, 1]")
    goal = target * (1 - 1e-12)
    lo, hi = 1e-9, 1e9
    if utilisation(method, work, hi) < goal:
        return math.inf
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if utilisation(method, work, mid) >= goal:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-9:
            break
    return hi

