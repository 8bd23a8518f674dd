"""The initial global model from a safetensors file on the syncer's disk (`diloco syncer --initial-model`).

With it no learner uploads the model: the first joiner's tensor specs lay the file's values out in fragments, and
learners that load the same checkpoint (or build the same model from the same seed) download nothing either, since
their digests match (digest.py). A file the syncer wrote itself (`model.safetensors`, a snapshot) works as well.
The file is checked at start, a tensor at a time, and read again when a learner joins (what it must hold is
known only then): only the tensors of the fragments this syncer owns."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.algorithm.fragments import TensorSpec, fitted_layout, values_of

log = logging.getLogger("diloco.syncer")


@dataclass
class InitialModelFile:
    """The file's tensor names and shapes; values are read from it when needed, a tensor at a time, so that a
    syncer (a shard) never holds more of the model than the fragments it lays out."""

    path: Path
    shapes: dict[str, tuple[int, ...]]

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read again; ValueError if the file no longer holds it as it did at start."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                t = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{self.path} could not be read again ({e}); it changed since the syncer started") from None
        if tuple(t.shape) != self.shapes[name]:
            raise ValueError(f"tensor {name!r} of {self.path} is {list(t.shape)} now and was "
                             f"{list(self.shapes[name])} when the syncer started")
        return t


def load(path: Path) -> InitialModelFile:
    """Check the file, a tensor at a time; ValueError says what is wrong with it."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise ValueError(f"--initial-model {path}: no such file")
    shapes = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"--initial-model {path}: tensor {name!r} holds NaN or Inf")
                shapes[name] = tuple(t.shape)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"--initial-model {path} is not a readable safetensors file ({e}); give the model's "
                         f"weights as saved by safetensors.torch.save_file or save_pretrained") from None
    if not shapes:
        raise ValueError(f"--initial-model {path} holds no tensors")
    return InitialModelFile(Path(path), shapes)


def fragment_values(specs: list[TensorSpec], fragments: int, source: InitialModelFile,
                    split: bool = False, owned=lambda index: True) -> list[torch.Tensor]:
    """The file's values as flat fp32 fragments in the layout these specs give with `fragments` and `split` (as
    `SyncerCore.initialize` plans it); a fragment not `owned(index)` (another shard's) as an empty tensor, its
    tensors not read. ValueError names the tensors the file lacks or holds in another shape."""
    wanted = [s for s in specs if s.kind != "alias"]
    missing = [s.name for s in wanted if s.name not in source.shapes]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"it has no tensor {', '.join(map(repr, missing[:3]))}{more}")
    for s in wanted:
        shape = source.shapes[s.name]
        if shape != tuple(s.shape):
            raise ValueError(f"tensor {s.name!r} is {list(shape)} in the file and {list(s.shape)} in the model")
    unused = set(source.shapes) - {s.name for s in specs}
    if unused:
        log.warning("--initial-model %s: %d tensors the model does not have are ignored (e.g. %r)", source.path,
                    len(unused), sorted(unused)[0])
    return [torch.cat([values_of(source.read(s.name).contiguous(), s).to(torch.float32) for s in f.specs])
            if owned(f.index) else torch.zeros(0) for f in fitted_layout(specs, fragments, split)]
