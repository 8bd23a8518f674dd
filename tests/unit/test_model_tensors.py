"""The learner's model tensors: walked once after join, again only when the model registers something new, and a
changed shape is refused at the next use."""

import pytest
import torch
from torch import nn

from diloco.algorithm.fragments import tensor_specs
from diloco.learner import model_tensors
from diloco.learner.model_tensors import ModelTensors


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 16)


def counting(monkeypatch):
    walks = []
    real = model_tensors.checked_state
    monkeypatch.setattr(model_tensors, "checked_state", lambda *a: (walks.append(1), real(*a))[1])
    return walks


def test_the_model_is_walked_once_however_many_times_its_tensors_are_used(monkeypatch):
    walks = counting(monkeypatch)
    model = Net()
    tensors = ModelTensors(model, tensor_specs(model))
    specs = tensor_specs(model)
    for _ in range(100):
        got = tensors.tensors(specs[:2])
    assert len(walks) == 1 and got[0] is model.body.weight


def test_assigning_a_module_parameter_or_buffer_walks_it_again(monkeypatch):
    walks = counting(monkeypatch)
    model, other = Net(), Net()
    tensors = ModelTensors(model, tensor_specs(model))
    specs = tensor_specs(model)
    tensors.state()
    other.head = nn.Linear(8, 16)  # another model's change is not ours
    tensors.state()
    assert len(walks) == 1
    model.head = nn.Linear(8, 16)
    assert tensors.tensors(specs[2:3])[0] is model.head.weight and len(walks) == 2
    model.body.weight = nn.Parameter(torch.zeros(8, 4))
    assert tensors.tensors(specs[:1])[0] is model.body.weight and len(walks) == 3
    model.body.register_buffer("scale", torch.ones(1))
    tensors.state()
    assert len(walks) == 4


def test_a_changed_shape_is_refused_at_the_next_use():
    model = Net()
    tensors = ModelTensors(model, tensor_specs(model))
    specs = tensor_specs(model)
    model.head.weight.data = torch.zeros(17, 8)  # in place: no registration hook fires
    with pytest.raises(ValueError, match=r"head.weight is \[17, 8\], it was \[16, 8\]"):
        tensors.tensors(specs)
    model.head = nn.Linear(8, 17)
    with pytest.raises(ValueError, match=r"head.weight is \[17, 8\], it was \[16, 8\]"):
        tensors.state()


def test_closing_removes_the_hooks():
    before = len(torch.nn.modules.module._global_module_registration_hooks)
    tensors = ModelTensors(Net(), tensor_specs(Net()))
    assert len(torch.nn.modules.module._global_module_registration_hooks) == before + 1
    tensors.close()
    assert len(torch.nn.modules.module._global_module_registration_hooks) == before
