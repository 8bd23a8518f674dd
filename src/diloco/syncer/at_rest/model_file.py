"""The global model as one safetensors file, written a fragment of Θ at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from diloco.atomic import save_tensor_stream


def model_stream(core) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], Iterator[torch.Tensor]]:
    """What `core.params()` holds, as a layout (name, dtype, shape) and its tensors in that order, made a fragment
    at a time: a file written from it costs one fragment of memory, not a model. `core`: a SyncerCore."""
    aliases: dict[str, list[str]] = {}
    for s in core.specs or []:
        if s.kind == "alias":
            aliases.setdefault(s.alias_of, []).append(s.name)
    layout = [(name, getattr(torch, s.dtype), tuple(s.shape)) for fs in core.owned for s in fs.fragment.specs
              for name in (s.name, *aliases.get(s.name, ()))]

    def tensors() -> Iterator[torch.Tensor]:
        for fs in core.owned:
            offset, theta = 0, fs.outer_values()
            for s in fs.fragment.specs:
                t = theta[offset : offset + s.numel].view(s.shape).to(getattr(torch, s.dtype))
                for _ in (s.name, *aliases.get(s.name, ())):
                    yield t
                offset += s.numel
            del theta
    return layout, tensors()


def save_model(core, path: Path, **metadata) -> None:
    """The global model as one safetensors file, written a fragment at a time (no copy of the whole model)."""
    layout, tensors = model_stream(core)
    save_tensor_stream(path, layout, tensors, metadata)
