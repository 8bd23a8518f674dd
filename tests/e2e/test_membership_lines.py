"""What the syncer tells its operator about membership: a refused join names the learner and why (and counts in
/status `refusals` by reason), and a first join, an absence, a return, a rejoin and a leave are each one distinct
line."""

import logging

import pytest
import torch
from torch import nn

from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread

from liveness import wait_for


def net(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 16))


def lines(caplog, text):
    return [r.getMessage() for r in caplog.records if r.name == "diloco.syncer" and text in r.getMessage()]


@pytest.fixture
def syncer():
    cfg = for_mode("decoupled", 2, fragments=2, sync_every=4, heartbeat_seconds=0.1, absent_after_seconds=1.0)
    s = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, token="s3cret"))
    yield s
    s.stop()


def test_refused_joins_are_logged_with_the_reason_and_counted_in_the_status(syncer, caplog):
    caplog.set_level(logging.INFO, logger="diloco.syncer")
    with pytest.raises(SyncerError, match="wrong or missing run token"):
        Learner(net(), GrpcTransport(syncer.address, token="guess", connect_timeout=5), "mallory")
    first = Learner(net(), GrpcTransport(syncer.address, token="s3cret"), "a")  # the run's model is this one
    with pytest.raises(SyncerError, match="model mismatch"):
        Learner(net(width=9), GrpcTransport(syncer.address, token="s3cret", connect_timeout=5), "b")
    wait_for(lambda: len(syncer.status.get("refusals", {})) >= 2)
    assert syncer.status["refusals"] == {"join: wrong or missing run token": 1, "join: model mismatch": 1}
    exposition = syncer.service.metrics.exposition().decode()
    assert 'diloco_refusals_total{reason="join: model mismatch"} 1.0' in exposition
    (token,) = lines(caplog, "refused the join of learner 'mallory'")
    assert "wrong or missing run token" in token
    (model,) = lines(caplog, "refused the join of learner 'b'")
    assert "model mismatch" in model
    first.close()


def crash(learner):
    """What SIGKILL does to a learner, seen from the syncer: its connection ends without a Leave."""
    learner.transport._closing.set()
    learner.transport.channel.close()


def test_first_join_absence_return_rejoin_and_leave_are_each_one_distinct_line(syncer, caplog):
    caplog.set_level(logging.INFO, logger="diloco.syncer")
    core = syncer.service.core
    first = Learner(net(), GrpcTransport(syncer.address, token="s3cret"), "a")
    session = first.transport.session
    assert lines(caplog, "learner a joined the run") and not lines(caplog, "rejoined")
    crash(first)
    wait_for(lambda: lines(caplog, "learner a is absent"))
    core.heartbeat("a", session)  # its old session is heard again (a healed partition)
    wait_for(lambda: lines(caplog, "learner a is back after"))
    crash_again = lines(caplog, "learner a is absent")
    wait_for(lambda: len(lines(caplog, "learner a is absent")) == len(crash_again) + 1)  # silent again
    again = Learner(net(), GrpcTransport(syncer.address, token="s3cret"), "a")  # a restarted process
    (rejoin,) = lines(caplog, "learner a rejoined under its id (new session)")
    assert "absent" in rejoin
    again.finish()
    (left,) = lines(caplog, "learner a left the run")
    assert len(lines(caplog, "learner a joined the run")) == 1 and len(lines(caplog, "is back after")) == 1
    assert len(lines(caplog, "learner a is absent")) == 2
