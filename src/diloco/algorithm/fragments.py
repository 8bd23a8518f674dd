"""Partition a model's tensors into P fragments, the unit of exchange (docs/algorithm.md §1).

Every learner and the syncer derive the identical layout from the ordered (name, shape, dtype, embedding)
list alone, so the layout never travels on the wire: only its signature does.
"""

from __future__ import annotations

import hashlib
import logging
import heapq
import math
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("diloco.algorithm.fragments")


KINDS = ("param", "buffer", "static", "alias")
"""What a state_dict entry is to the run: a trained parameter (merged), a floating-point buffer (averaged on a
schedule, or kept local), a static tensor (a frozen parameter or an integer buffer: set from the global model on
join, never merged) or an alias (a second name of an earlier tensor, e.g. a tied output head)."""


@dataclass(frozen=True)
class TensorSpec:
    """What the layout needs to know about one entry of a model's state_dict."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    embedding: bool = False
    kind: str = "param"
    alias_of: str = ""
    """For an alias: the name of the tensor it shares."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        if self.kind == "alias":
            return f"{self.name} (tied to {self.alias_of})"
        kind = {"param": "", "buffer": " (buffer)", "static": " (frozen)"}[self.kind]
        return f"{self.name} {list(self.shape)} {self.dtype}{' (embedding)' if self.embedding else ''}{kind}"


@dataclass(frozen=True)
class Fragment:
    """One group of whole tensors; `specs` keep the model's order, which is also the payload order.

    `role` is "params" for the P fragments of trained parameters, "buffers" for the floating-point buffers and
    "static" for frozen parameters and integer buffers; the last two follow the P parameter fragments."""

    index: int
    specs: tuple[TensorSpec, ...]
    role: str = "params"

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def embedding(self) -> bool:
        return all(s.embedding for s in self.specs)


WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DistributedDataParallel, DataParallel and torch.compile wrappers: the same tensors
    under the bare model's names, so a wrapped learner has the same signature as a bare one."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def clean_name(name: str) -> str:
    """A state_dict key without the segments wrappers insert (`_orig_mod.` from torch.compile on a submodule,
    `_checkpoint_wrapped_module.` from activation checkpointing, FSDP1's `_fsdp_wrapped_module.`)."""
    parts = [p for p in name.split(".") if p + "." not in WRAPPER_PREFIXES[1:]]
    return ".".join(parts)


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the model's state_dict by its clean name: the live Parameter and buffer objects."""
    return {clean_name(k): v for k, v in unwrap(model).state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor)}


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_specs(model: nn.Module, embedding_names: set[str] | None = None) -> list[TensorSpec]:
    """Specs of a model's whole state_dict in its order: trained parameters, frozen ones, buffers and aliases.

    Embedding tensors are the weights of `nn.Embedding` modules, unless `embedding_names` names them explicitly.
    A name whose tensor already appeared under an earlier name (a tied head) is an alias of it.
    """
    bare = unwrap(model)
    if embedding_names is None:
        embedding_ids = {id(m.weight) for m in bare.modules() if isinstance(m, nn.Embedding)}
        embedding_names = {n for n, t in named_state(bare).items() if id(t) in embedding_ids}
    specs, first_name = [], {}
    for name, t in named_state(bare).items():
        if id(t) in first_name:
            specs.append(TensorSpec(name, tuple(t.shape), dtype_name(t), kind="alias", alias_of=first_name[id(t)]))
            continue
        first_name[id(t)] = name
        if isinstance(t, nn.Parameter) and t.requires_grad:
            kind = "param"
        elif not isinstance(t, nn.Parameter) and t.is_floating_point():
            kind = "buffer"
        else:
            kind = "static"
        specs.append(TensorSpec(name, tuple(t.shape), dtype_name(t), kind == "param" and name in embedding_names, kind))
    return specs


def signature(specs: list[TensorSpec]) -> str:
    """Hash of the ordered spec list: equal signatures mean identical layouts."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}|{s.shape}|{s.dtype}|{int(s.embedding)}|{s.kind}|{s.alias_of}\n".encode())
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
    params = [s for s in specs if s.kind == "param"]
    others = sum(not s.embedding for s in params)
    return others + (1 if others < len(params) else 0)


def fit_fragments(specs: list[TensorSpec], num_fragments: int) -> int:
    """`num_fragments`, lowered to the most this model allows (fragments are whole tensors), with a warning."""
    limit = max_fragments(specs)
    if num_fragments > limit >= 1:
        log.warning("this model has %d trained tensors that can form at most %d fragments; using P = %d instead of "
                    "%d (pass --fragments %d to silence this)", sum(s.kind == "param" for s in specs), limit, limit,
                    num_fragments, limit)
        return limit
    return num_fragments


def fitted_layout(specs: list[TensorSpec], num_fragments: int) -> list[Fragment]:
    """The layout the syncer adopts for `num_fragments` (lowered as `fit_fragments` does): what a learner offering
    its initial values and a syncer laying out a checkpoint must both derive."""
    return plan_fragments(specs, fit_fragments(specs, num_fragments))


def plan_fragments(specs: list[TensorSpec], num_fragments: int) -> list[Fragment]:
    """Balanced layout of the trained parameters: embeddings apart, the rest by longest-processing-time greedy on
    element count; then one fragment of floating-point buffers and one of static tensors, when the model has any.

    With P = 1 every parameter shares one fragment (merge still treats embedding tensors per tensor).
    """
    params = [s for s in specs if s.kind == "param"]
    if not params:
        raise ValueError("the model has no trainable parameters to synchronise")
    limit = max_fragments(specs)
    if not 1 <= num_fragments <= limit:
        others = sum(not s.embedding for s in params)
        raise ValueError(
            f"cannot split this model into {num_fragments} fragments: fragments are whole tensors and it has "
            f"{others} non-embedding tensors{' plus one embedding fragment' if limit > others else ''}; "
            f"choose --fragments between 1 and {limit}"
        )
    fragments = _plan_params(params, num_fragments)
    for role, kind in (("buffers", "buffer"), ("static", "static")):
        group = tuple(s for s in specs if s.kind == kind)
        if group:
            fragments.append(Fragment(len(fragments), group, role))
    return fragments


def _plan_params(specs: list[TensorSpec], num_fragments: int) -> list[Fragment]:
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


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor's whole value: a sharded DTensor (FSDP2) is all-gathered, a collective every rank must join."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gather(params: dict[str, torch.Tensor], fragment: Fragment) -> torch.Tensor:
    """The fragment's tensors as one flat fp32 CPU vector (a copy)."""
    return torch.cat([full(params[s.name]).detach().reshape(-1).to("cpu", torch.float32) for s in fragment.specs])


def scatter(flat: torch.Tensor, params: dict[str, torch.Tensor], fragment: Fragment) -> None:
    """Copy a flat vector back into the fragment's tensors, in place, converting device and dtype. A sharded
    DTensor takes its own shard of the values (every rank holds the whole flat vector)."""
    offset = 0
    with torch.no_grad():
        for s in fragment.specs:
            p = params[s.name]
            values = flat[offset : offset + s.numel].view(s.shape)
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                values = distribute_tensor(values.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(values.to_local())
            else:
                p.copy_(values.view(p.shape))
            offset += s.numel


def segments(fragment: Fragment) -> list[tuple[int, bool]]:
    """(element count, is-embedding) per tensor, in payload order: what the merge needs."""
    return [(s.numel, s.embedding) for s in fragment.specs]
