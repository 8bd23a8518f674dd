"""Partition a model's tensors into P fragments, the unit of exchange (docs/algorithm.md §1).

Every learner and the syncer derive the identical layout from the ordered (name, shape, dtype, embedding)
list and the run's `split_tensors` switch alone, so the layout never travels on the wire: only its signature does.
Fragments are whole tensors, as published; with `split_tensors` a tensor larger than a fragment's share of the model
is cut into pieces (contiguous ranges of its flattened values) in several fragments, so that no fragment holds half
the model (a tied embedding and head, 47% of a 36M GPT) and no push or apply costs more than any other.
"""

from __future__ import annotations

import dataclasses
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
    start: int = 0
    stop: int | None = None
    """A piece of the tensor (a split layout's): its flattened values start..stop; None: the whole tensor."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.stop is None else self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.stop is None

    def piece(self, start: int, stop: int) -> "TensorSpec":
        return dataclasses.replace(self, start=start, stop=stop)

    def describe(self) -> str:
        if not self.whole:
            return f"{self.name} [{self.start}:{self.stop}] of {list(self.shape)}"
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


def max_fragments(specs: list[TensorSpec], split: bool = False) -> int:
    params = [s for s in specs if s.kind == "param"]
    if split:  # a fragment holds at least one value
        return sum(s.numel for s in params)
    others = sum(not s.embedding for s in params)
    return others + (1 if others < len(params) else 0)


def fit_fragments(specs: list[TensorSpec], num_fragments: int, split: bool = False) -> int:
    """`num_fragments`, lowered to the most this model allows (fragments are whole tensors), with a warning."""
    limit = max_fragments(specs, split)
    if num_fragments > limit >= 1:
        log.warning("this model has %d trained tensors that can form at most %d fragments; using P = %d instead of "
                    "%d (pass --fragments %d to silence this)", sum(s.kind == "param" for s in specs), limit, limit,
                    num_fragments, limit)
        return limit
    return num_fragments


def fitted_layout(specs: list[TensorSpec], num_fragments: int, split: bool = False) -> list[Fragment]:
    """The layout the syncer adopts for `num_fragments` (lowered as `fit_fragments` does): what a learner offering
    its initial values and a syncer laying out a checkpoint must both derive."""
    return plan_fragments(specs, fit_fragments(specs, num_fragments, split), split)


def plan_fragments(specs: list[TensorSpec], num_fragments: int, split: bool = False) -> list[Fragment]:
    """Balanced layout of the trained parameters: embeddings apart, the rest by longest-processing-time greedy on
    element count; then one fragment of floating-point buffers and one of static tensors, when the model has any.
    `split`: tensors larger than a fragment's share are cut into pieces first (`_plan_split`).

    With P = 1 every parameter shares one fragment (merge still treats embedding tensors per tensor).
    """
    params = [s for s in specs if s.kind == "param"]
    if not params:
        raise ValueError("the model has no trainable parameters to synchronise")
    limit = max_fragments(specs, split)
    if not 1 <= num_fragments <= limit:
        others = sum(not s.embedding for s in params)
        whole = ("fragments are whole tensors and it has "
                 f"{others} non-embedding tensors{' plus one embedding fragment' if limit > others else ''}")
        raise ValueError(f"cannot split this model into {num_fragments} fragments: "
                         f"{f'it has {limit} trained values' if split else whole}; choose --fragments between 1 and "
                         f"{limit}")
    if num_fragments == 1:
        fragments = [Fragment(0, tuple(params))]
    else:
        fragments = _plan_split(params, num_fragments) if split else _plan_params(params, num_fragments)
    for role, kind in (("buffers", "buffer"), ("static", "static")):
        group = tuple(s for s in specs if s.kind == kind)
        if group:
            fragments.append(Fragment(len(fragments), group, role))
    return fragments


def _plan_params(specs: list[TensorSpec], num_fragments: int) -> list[Fragment]:
    embeddings = [s for s in specs if s.embedding]
    others = [s for s in specs if not s.embedding]
    bins = num_fragments - (1 if embeddings else 0)
    first = 1 if embeddings else 0
    fragments = [Fragment(0, tuple(embeddings))] if embeddings else []
    for i, group in enumerate(_greedy(others, bins)):
        fragments.append(Fragment(first + i, group))
    return fragments


def _greedy(specs: list[TensorSpec], bins: int) -> list[tuple[TensorSpec, ...]]:
    """Longest-processing-time greedy: each spec, largest first, into the bin with the fewest elements so far;
    every bin keeps the model's order (pieces of one tensor by their start)."""
    heap = [(0, i) for i in range(bins)]  # (elements so far, bin) pops the smallest, ties to the lowest bin
    assigned: dict[tuple[str, int], int] = {}
    for s in sorted(specs, key=lambda s: (-s.numel, s.name, s.start)):
        total, i = heapq.heappop(heap)
        assigned[s.name, s.start] = i
        heapq.heappush(heap, (total + s.numel, i))
    return [tuple(s for s in specs if assigned[s.name, s.start] == i) for i in range(bins)]


def _plan_split(specs: list[TensorSpec], num_fragments: int) -> list[Fragment]:
    """Fragments of at most about a P-th of the model each. The embeddings get fragments of their own in proportion
    to their size (at least one; at most P − 1 when there are other tensors), their values laid end to end and cut
    into equal ranges; every other tensor larger than the rest's share per fragment, rounded down, is cut into
    near-equal pieces of at most that share, and the pieces and whole tensors are placed by `_greedy`. Every fragment
    then holds at least one value, and a cut tensor's pieces keep its order within each fragment."""
    embeddings = [s for s in specs if s.embedding]
    others = [s for s in specs if not s.embedding]
    total, held = sum(s.numel for s in specs), sum(s.numel for s in embeddings)
    if not embeddings:
        count = 0
    elif not others:
        count = num_fragments
    else:
        count = min(num_fragments - 1, max(1, round(num_fragments * held / total)))
    fragments = [Fragment(i, group) for i, group in enumerate(_ranges(embeddings, count))]
    bins = num_fragments - count
    if bins:
        share = sum(s.numel for s in others) // bins
        pieces = []
        for s in others:
            cuts = -(-s.numel // share)
            pieces += [s] if cuts == 1 else [s.piece(s.numel * k // cuts, s.numel * (k + 1) // cuts) for k in range(cuts)]
        fragments += [Fragment(count + i, group) for i, group in enumerate(_greedy(pieces, bins))]
    return fragments


def _ranges(specs: list[TensorSpec], count: int) -> list[tuple[TensorSpec, ...]]:
    """The specs' values laid end to end, cut into `count` ranges of near-equal size, each as whole tensors and
    pieces."""
    total = sum(s.numel for s in specs)
    out: list[tuple[TensorSpec, ...]] = []
    for k in range(count):
        lo, hi = total * k // count, total * (k + 1) // count
        group, offset = [], 0
        for s in specs:
            a, b = max(lo, offset), min(hi, offset + s.numel)
            if a < b:
                group.append(s if (a, b) == (offset, offset + s.numel) else s.piece(a - offset, b - offset))
            offset += s.numel
        out.append(tuple(group))
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor's whole value: a sharded DTensor (FSDP2) is all-gathered, a collective every rank must join."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def values_of(t: torch.Tensor, s: TensorSpec) -> torch.Tensor:
    """The values `s` stands for in its tensor `t`, flattened: the whole tensor or a piece of it. A piece is a view
    (writes reach the tensor), so its tensor must be contiguous."""
    if s.whole:
        return t.reshape(-1)
    if not t.is_contiguous():
        raise ValueError(f"tensor {s.name} is not contiguous in memory (channels_last?), so a piece of it cannot be "
                         f"written in place; make it contiguous or run without --split-tensors")
    return t.view(-1)[s.start : s.stop]


def part(t: torch.Tensor, s: TensorSpec) -> torch.Tensor:
    """What `s` stands for in `t`: the tensor itself, or a flat view of its piece."""
    return t if s.whole else values_of(t, s)


def gather(params: dict[str, torch.Tensor], fragment: Fragment) -> torch.Tensor:
    """The fragment's tensors as one flat fp32 CPU vector (a copy)."""
    return torch.cat([values_of(full(params[s.name]).detach(), s).to("cpu", torch.float32) for s in fragment.specs])


def scatter(flat: torch.Tensor, params: dict[str, torch.Tensor], fragment: Fragment) -> None:
    """Copy a flat vector back into the fragment's tensors, in place, converting device and dtype. A sharded
    DTensor takes its own shard of the values (every rank holds the whole flat vector)."""
    offset = 0
    with torch.no_grad():
        for s in fragment.specs:
            p = params[s.name]
            values = flat[offset : offset + s.numel]
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                if not s.whole:  # a piece: the rest of the tensor keeps its values
                    whole = full(p).detach().reshape(-1).clone()
                    whole[s.start : s.stop] = values.to(whole.device, whole.dtype)
                    values = whole
                values = distribute_tensor(values.view(s.shape).to(p.device), p.device_mesh, p.placements,
                                           src_data_rank=None)
                p.to_local().copy_(values.to_local())
            elif s.whole:
                p.copy_(values.view(p.shape))
            else:
                values_of(p, s).copy_(values)
            offset += s.numel


def segments(fragment: Fragment) -> list[tuple[int, bool]]:
    """(element count, is-embedding) per tensor, in payload order: what the merge needs."""
    return [(s.numel, s.embedding) for s in fragment.specs]
