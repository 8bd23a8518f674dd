"""The initial global model from a safetensors file on the syncer's disk (`diloco syncer --initial-model`).

With it no learner uploads the model: the first joiner's tensor specs lay the file's values out in fragments, and
learners that load the same checkpoint (or build the same model from the same seed) download nothing either, since
their digests match (digest.py). A file the syncer wrote itself (`model.safetensors`, a snapshot) works as well.
The file is read whole at start and checked then; what it must hold is known only when a learner joins."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.algorithm.fragments import TensorSpec, fitted_layout, values_of

log = logging.getLogger("diloco.syncer")


@dataclass
class InitialModelFile:
    path: Path
    tensors: dict[str, torch.Tensor]


def load(path: Path) -> InitialModelFile:
    """Read and check the file; ValueError says what is wrong with it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise ValueError(f"--initial-model {path}: no such file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"--initial-model {path} is not a readable safetensors file ({e}); give the model's "
                         f"weights as saved by safetensors.torch.save_file or save_pretrained") from None
    if not tensors:
        raise ValueError(f"--initial-model {path} holds no tensors")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"--initial-model {path}: tensor {name!r} holds NaN or Inf")
    return InitialModelFile(Path(path), tensors)


def fragment_values(specs: list[TensorSpec], fragments: int, source: InitialModelFile,
                    split: bool = False, owned=lambda index: True) -> list[torch.Tensor]:
    """The file's values as flat fp32 fragments in the layout these specs give with `fragments` and `split` (as
    `SyncerCore.initialize` plans it); a fragment not `owned(index)` (another shard's) as an empty tensor.
    ValueError names the tensors the file lacks or holds in another shape."""
    wanted = [s for s in specs if s.kind != "alias"]
    missing = [s.name for s in wanted if s.name not in source.tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"it has no tensor {', '.join(map(repr, missing[:3]))}{more}")
    for s in wanted:
        shape = tuple(source.tensors[s.name].shape)
        if shape != tuple(s.shape):
            raise ValueError(f"tensor {s.name!r} is {list(shape)} in the file and {list(s.shape)} in the model")
    unused = set(source.tensors) - {s.name for s in specs}
    if unused:
        log.warning("--initial-model %s: %d tensors the model does not have are ignored (e.g. %r)", source.path,
                    len(unused), sorted(unused)[0])
    return [torch.cat([values_of(source.tensors[s.name].contiguous(), s).to(torch.float32) for s in f.specs])
            if owned(f.index) else torch.zeros(0) for f in fitted_layout(specs, fragments, split)]
