"""The global model as one safetensors file, written a fragment of Θ at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from diloco.atomic import save_tensor_stream


def model_stream(core) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], Iterator[torch.Tensor]]:
    """What `core.params()` holds, as a layout (name, dtype, shape) and its tensors in that order, made a fragment
    at a time: a file written from it costs one fragment of memory, not a model (plus, in a split layout, the tensors
    whose pieces have not all been read yet). `core`: a SyncerCore."""
    aliases: dict[str, list[str]] = {}
    for s in core.specs or []:
        if s.kind == "alias":
            aliases.setdefault(s.alias_of, []).append(s.name)
    missing = {}  # a split tensor's values not yet read
    for fs in core.owned:
        for s in fs.fragment.specs:
            missing[s.name] = missing.get(s.name, 0) + s.numel
    layout = [(name, getattr(torch, s.dtype), tuple(s.shape)) for s in _completed(core.owned, dict(missing))
              for name in (s.name, *aliases.get(s.name, ()))]

    def tensors() -> Iterator[torch.Tensor]:
        partial: dict[str, torch.Tensor] = {}
        left = dict(missing)
        for fs in core.owned:
            offset, theta = 0, fs.outer_values()
            for s in fs.fragment.specs:
                values = theta[offset : offset + s.numel]
                offset += s.numel
                if s.whole:
                    t = values.view(s.shape).to(getattr(torch, s.dtype))
                else:
                    t = partial.setdefault(s.name, torch.empty(s.shape, dtype=getattr(torch, s.dtype)))
                    t.view(-1)[s.start : s.stop] = values
                    left[s.name] -= s.numel
                    if left[s.name]:
                        continue
                    del partial[s.name]
                for _ in (s.name, *aliases.get(s.name, ())):
                    yield t
            del theta
    return layout, tensors()


def _completed(owned, left: dict[str, int]):
    """The specs of `owned` fragments in the order their tensors are complete (whole ones at once, a split one with
    its last piece): the order `model_stream` yields them."""
    for fs in owned:
        for s in fs.fragment.specs:
            left[s.name] -= s.numel
            if not left[s.name]:
                yield s


def save_model(core, path: Path, **metadata) -> None:
    """The global model as one safetensors file, written a fragment at a time (no copy of the whole model)."""
    layout, tensors = model_stream(core)
    save_tensor_stream(path, layout, tensors, metadata)
