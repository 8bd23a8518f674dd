"""A learner's own values, offered as the initial global model and described by their digests."""

from __future__ import annotations

import torch

from diloco.algorithm.digest import tensor_digests
from diloco.algorithm.fragments import Fragment, TensorSpec, fitted_layout, gather


class InitialValues:
    """This learner's values as the initial global model, fragment by fragment: each flat fp32 copy is made when it
    is read and dropped after, so uploading a big model never holds a second copy of it."""

    def __init__(self, layout: list[Fragment], state: dict[str, torch.Tensor]):
        self.layout, self.state = layout, state

    def __len__(self) -> int:
        return len(self.layout)

    def __iter__(self):
        for f in self.layout:
            yield gather(self.state, f)

    def flat(self, index: int) -> torch.Tensor:
        """Fragment `index`'s values (a fresh fp32 copy)."""
        return gather(self.state, self.layout[index])


class InitialModel:
    """What a joining learner holds: `model(P)` gives its values in P fragments (to upload, or to keep where the
    syncer finds it already holds them), `digests()` one digest per tensor spec. Each is worked out once."""

    def __init__(self, specs: list[TensorSpec], state: dict[str, torch.Tensor]):
        self.specs, self.state = specs, state
        self._digests: list[bytes] | None = None
        self._layouts: dict[tuple[int, bool], InitialValues] = {}

    def __call__(self, num_fragments: int, split: bool = False) -> InitialValues:
        """The values in the syncer's layout: `num_fragments` and its `split_tensors`."""
        if (num_fragments, split) not in self._layouts:
            self._layouts[num_fragments, split] = InitialValues(fitted_layout(self.specs, num_fragments, split),
                                                                self.state)
        return self._layouts[num_fragments, split]

    def digests(self) -> list[bytes]:
        if self._digests is None:
            self._digests = tensor_digests(self.specs, self.state)
        return self._digests
