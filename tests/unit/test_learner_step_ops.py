"""What `Learner.step` runs on the training thread for a push and an apply, counted op by op (views excluded): a
snapshot is one copy of the whole fragment and an apply one fused operation per arithmetic step, however many tensors
the fragment has (here 20): on a GPU one or two kernel launches each, not one per tensor."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from diloco import Learner, for_mode
from diloco.learner.transport import Arrival
from recording import Recording


class CountedOps(TorchDispatchMode):
    """The non-view aten ops run under it, by name, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep_overlap,apply_ops", [(True, ["_foreach_sub_", "_foreach_add_"]),
                                                    (False, ["_foreach_copy_"])])
@pytest.mark.parametrize("options", [dict(codec="int4", device_codec=True), dict(codec="int8", device_codec=False)],
                         ids=["device codec", "host codec"])
def test_a_push_is_one_copy_and_an_apply_one_fused_operation_per_step(keep_overlap, apply_ops, options):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)])  # 40 tensors, 20 per fragment
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=2, overlap=1, codec=options["codec"],
                   keep_overlap=keep_overlap)
    transport = Recording(cfg)
    learner = Learner(model, transport, "a", device_codec=options["device_codec"])
    for step in range(6):
        job = transport.jobs[-1] if transport.jobs else None
        if job is not None:  # the last push's answer arrives, to be applied at this step (overlap 1)
            slot = learner._slot[job.fragment]
            slot.ready = Arrival(job.fragment, slot.version + 1, slot.base + 0.01, "", job.seq)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.001)
        counted = CountedOps()
        with counted:
            learner.step(64)
        assert counted.ops == ["cat"] + (apply_ops if step else []), step
    assert learner.applied == 5 and learner.pushes == 6
