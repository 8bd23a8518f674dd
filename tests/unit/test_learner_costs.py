"""The learner says what it costs: Learner.step's host time (median, longest), the training thread's waits for a
merged fragment that was due, and pinned memory allocated since join."""

import time

import torch
from torch import nn

from diloco import Learner, LocalSyncer, LocalTransport, for_mode
from diloco.learner import costs
from diloco.syncer.core import SyncerCore


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))


class LateArrivals(LocalTransport):
    """Merged fragments reach the learner only after it has waited `delay` seconds for them."""

    delay = 0.05

    def arrivals(self, timeout=None):
        if timeout is None:  # a look without waiting finds nothing yet
            return []
        time.sleep(self.delay)  # a blocking wait: the training thread is held here
        return super().arrivals(None)


def test_step_host_time_is_measured_and_a_learner_that_never_waits_waited_nothing():
    learner = Learner(net(), LocalTransport(LocalSyncer(SyncerCore(for_mode("decoupled", 1, fragments=2,
                                                                             sync_every=4)))), "a")
    for _ in range(12):
        learner.step(16)
    summary = learner.costs.summary()
    assert len(learner.costs.recent) == 12
    assert 0 < summary["host_ms_median"] <= summary["host_ms_max"]
    assert summary["host_ms_max"] == round(1e3 * max(learner.costs.recent), 4)
    assert summary["waited_seconds"] == 0 and summary["pinned_bytes"] == 0  # a CPU model pins nothing
    learner.finish(timeout=30)


def test_waiting_for_a_due_fragment_is_counted():
    cfg = for_mode("streaming", 1, fragments=2, sync_every=4, overlap=1)  # waits for merges that are due
    transport = LateArrivals(LocalSyncer(SyncerCore(cfg)))
    learner = Learner(net(), transport, "a")
    for _ in range(8):
        learner.step(16)
    summary = learner.costs.summary()
    waits = summary["waited_seconds"] / LateArrivals.delay
    assert waits >= 1, summary
    assert summary["host_ms_max"] >= 1e3 * LateArrivals.delay  # the wait is inside step()
    learner.finish(timeout=30)


def test_pinned_memory_since_join_is_counted_process_wide():
    learner = Learner(net(), LocalTransport(LocalSyncer(SyncerCore(for_mode("decoupled", 1)))), "a")
    costs.PINNED.add(4096)  # what a CUDA learner's fragment copies add
    assert learner.costs.summary()["pinned_bytes"] == 4096
    learner.finish(timeout=30)
