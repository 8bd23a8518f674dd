"""The learner's model's tensors by name, walked once after join instead of twice a step.

Walking a model's state_dict costs about half a millisecond a call at 35M parameters, and a push and an apply each
needed one every step. The walk is kept and taken again only when the model itself says it changed: torch's global
registration hooks fire whenever a parameter, buffer or submodule is assigned to one of its modules. A tensor whose
shape changes in place (`p.data = ...`) is caught by checking the shapes of the tensors a fragment uses, at each use.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.modules import module as torch_module

from diloco.algorithm.fragments import TensorSpec, named_state, part, unwrap


def checked_state(model: torch.nn.Module, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """The model's tensors by name, every one of `specs` present with its shape."""
    state = named_state(model)
    for s in specs:
        check(state.get(s.name), s)
    return state


def check(t: torch.Tensor | None, s: TensorSpec) -> None:
    if t is None or tuple(t.shape) != s.shape:
        got = "missing" if t is None else f"{list(t.shape)}"
        raise ValueError(f"the model changed after joining: tensor {s.name} is {got}, it was {list(s.shape)}; "
                         f"a learner's model must keep the shape it joined with (start a new Learner)")


class ModelTensors:
    """`state()` is `checked_state(model, specs)`, walked again only after one of the model's modules registered a
    new parameter, buffer or submodule; `close()` removes the hooks (they hold the instance weakly meanwhile)."""

    def __init__(self, model: torch.nn.Module, specs: list[TensorSpec]):
        self.model, self.specs = model, specs
        self._state: dict[str, torch.Tensor] | None = None
        self._modules: set[int] = set()
        ref = weakref.ref(self)

        def changed(module, name, value):
            owner = ref()
            if owner is not None and id(module) in owner._modules:
                owner._state = None
            return None  # keep what is being registered

        self._hooks = [torch_module.register_module_parameter_registration_hook(changed),
                       torch_module.register_module_buffer_registration_hook(changed),
                       torch_module.register_module_module_registration_hook(changed)]

    def state(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            self._modules = {id(m) for m in unwrap(self.model).modules()} | {id(self.model)}
            self._state = checked_state(self.model, self.specs)
        return self._state

    def tensors(self, specs) -> list[torch.Tensor]:
        """The tensors of `specs` (a fragment's), their shapes checked; a piece as a flat view of its part."""
        state = self.state()
        out = []
        for s in specs:
            t = state.get(s.name)
            check(t, s)
            out.append(part(t, s))
        return out

    def close(self) -> None:
        for hook in self._hooks:
            try:
                hook.remove()
            except (AttributeError, KeyError, TypeError):  # at interpreter exit torch's tables may be gone
                pass
        self._hooks = []

    def __del__(self):
        self.close()
