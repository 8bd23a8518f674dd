"""Partition a model's tensors into P fragments, the unit of exchange (DESIGN §3.1).

Every learner and the syncer derive the identical layout from the ordered (name, shape, dtype, embedding)
list alone, so the layout never travels on the wire: only its signature does.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """What the layout needs to know about one parameter tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        kind = " (embedding)" if self.embedding else ""
        return f"{self.name} {list(self.shape)} {self.dtype}{kind}"


@dataclass(frozen=True)
class Fragment:
    """One group of whole tensors; `specs` keep the model's order, which is also the payload order."""

    index: int
    specs: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def embedding(self) -> bool:
        return all(s.embedding for s in self.specs)


def tensor_specs(model: nn.Module, embedding_names: set[str] | None = None) -> list[TensorSpec]:
    """Specs of a model's trainable parameters in registration order.

    Embedding tensors are the weights of `nn.Embedding` modules (a head tied to one shares its Parameter, so
    `named_parameters` already lists it once), unless `embedding_names` names them explicitly.
    """
    if embedding_names is None:
        embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        embedding_names = {n for n, p in model.named_parameters() if id(p) in embedding_ids}
    specs = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        specs.append(TensorSpec(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), name in embedding_names))
    return specs


def signature(specs: list[TensorSpec]) -> str:
    """Hash of the ordered spec list: equal signatures mean identical layouts."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}|{s.shape}|{s.dtype}|{int(s.embedding)}\n".encode())
    return h.hexdigest()[:16]


def first_difference(ours: list[TensorSpec], theirs: list[TensorSpec]) -> str | None:
    """A sentence naming the first tensor where two spec lists differ, or None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"tensor #{i}: expected {a.describe()}, got {b.describe()}"
    if len(ours) != len(theirs):
        i = min(len(ours), len(theirs))
        if len(ours) > len(theirs):
            return f"tensor #{i}: expected {ours[i].describe()}, got nothing (the model has fewer tensors)"
        return f"tensor #{i}: expected nothing, got {theirs[i].describe()} (the model has more tensors)"
    return None


def max_fragments(specs: list[TensorSpec]) -> int:
    others = sum(not s.embedding for s in specs)
    return others + (1 if others < len(specs) else 0)


def plan_fragments(specs: list[TensorSpec], num_fragments: int) -> list[Fragment]:
    """Balanced layout: embeddings apart, the rest by longest-processing-time greedy on element count.

    With P = 1 everything shares one fragment (merge still treats embedding tensors per tensor).
    """
    if not specs:
        raise ValueError("the model has no trainable parameters to synchronise")
    limit = max_fragments(specs)
    if not 1 <= num_fragments <= limit:
        others = sum(not s.embedding for s in specs)
        raise ValueError(
            f"cannot split this model into {num_fragments} fragments: fragments are whole tensors and it has "
            f"{others} non-embedding tensors{' plus one embedding fragment' if limit > others else ''}; "
            f"choose --fragments between 1 and {limit}"
        )
    if num_fragments == 1:
        return [Fragment(0, tuple(specs))]
    embeddings = [s for s in specs if s.embedding]
    others = [s for s in specs if not s.embedding]
    bins = num_fragments - (1 if embeddings else 0)
    heap = [(0, i) for i in range(bins)]  # (elements so far, bin) pops the smallest, ties to the lowest bin
    assigned: dict[str, int] = {}
    for s in sorted(others, key=lambda s: (-s.numel, s.name)):
        total, i = heapq.heappop(heap)
        assigned[s.name] = i
        heapq.heappush(heap, (total + s.numel, i))
    first = 1 if embeddings else 0
    fragments = [Fragment(0, tuple(embeddings))] if embeddings else []
    for i in range(bins):
        fragments.append(Fragment(first + i, tuple(s for s in others if assigned[s.name] == i)))
    return fragments


def gather(params: dict[str, torch.Tensor], fragment: Fragment) -> torch.Tensor:
    """The fragment's tensors as one flat fp32 CPU vector (a copy)."""
    return torch.cat([params[s.name].detach().reshape(-1).to("cpu", torch.float32) for s in fragment.specs])


def scatter(flat: torch.Tensor, params: dict[str, torch.Tensor], fragment: Fragment) -> None:
    """Copy a flat vector back into the fragment's tensors, in place, converting device and dtype."""
    offset = 0
    with torch.no_grad():
        for s in fragment.specs:
            p = params[s.name]
            p.copy_(flat[offset : offset + s.numel].view(p.shape))
            offset += s.numel


def segments(fragment: Fragment) -> list[tuple[int, bool]]:
    """(element count, is-embedding) per tensor, in payload order: what the merge needs."""
    return [(s.numel, s.embedding) for s in fragment.specs]
