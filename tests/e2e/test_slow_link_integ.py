"""Big models over slow links: transfers have no fixed deadline, only a stall timeout whose error says the link is
slow; finish delivers every push or says which were not delivered."""

import contextlib
import threading
import time

import grpc
import pytest
import torch
from torch import nn

from diloco.chaos import LinkFaults, ProxyThread
from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread

from liveness import wait_for

pytestmark = pytest.mark.timeout(180)


def big(seed=0):
    """About 26 MB of fp32: 13 s each way over a 2 MB/s link."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(256, 1024), *(nn.Linear(1024, 1024) for _ in range(6)))


def model_bytes(model) -> int:
    return sum(4 * p.numel() for p in model.parameters())


def train(learner, model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        learner.step(8, loss=loss.item())


@contextlib.contextmanager
def syncer_and_proxy(fragments=3, sync_every=4, **faults):
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=fragments, sync_every=sync_every, heartbeat_seconds=0.2),
                          ServerOptions(listen="127.0.0.1:0", http=None))
    proxy = ProxyThread(syncer.address, faults=LinkFaults(**faults))
    try:
        yield syncer, proxy
    finally:
        proxy.stop()
        syncer.stop()


@pytest.mark.slow
def test_a_big_model_joins_trains_and_finishes_over_a_slow_link():
    model = big()
    size = model_bytes(model)
    with syncer_and_proxy(bandwidth_bps=1e6) as (syncer, proxy):  # bytes/s: 26 s each way for the 26 MB model
        started = time.monotonic()
        # uploads the initial model, far longer than the 5 s RPC timeout (and is not sent it back). The 12 s stall
        # timeout is half the transfer, so a watchdog that timed the transfer rather than its progress fails here;
        # it leaves room for the chunks gRPC holds in flight to drain and a loaded syncer to answer once all is sent.
        learner = Learner(model, GrpcTransport(proxy.address, rpc_timeout=5, stall_timeout=12), "slow")
        assert time.monotonic() - started > 5 and proxy.bytes_up >= size and proxy.bytes_down < size / 10
        started = time.monotonic()  # a learner with other weights downloads the global model, as long
        other = Learner(big(seed=1), GrpcTransport(proxy.address, rpc_timeout=5, stall_timeout=12), "other")
        assert time.monotonic() - started > 5 and proxy.bytes_down >= size
        other.close()
        train(learner, model, 12)  # every fragment is due at least twice (H = 4)
        assert learner.pushes >= 3
        learner.finish()
        assert learner.transport.undelivered == 0 and learner.transport.error is None
        final = syncer.stop()
    assert final["rounds"] >= 3
    assert all(v >= 1 for v in final["versions"]), final["versions"]  # every fragment's push was merged
    assert sum(final["pending"]) == 0


def test_a_stalled_join_says_the_link_is_slow_not_that_the_syncer_is_missing():
    with syncer_and_proxy(bandwidth_bps=50e3) as (syncer, proxy):
        first = Learner(big(), GrpcTransport(syncer.address), "first")  # initialises the syncer, at loopback speed
        started = time.monotonic()
        # one 2 MiB chunk takes 40 s at 50 kB/s; 5 s is room for a loaded syncer's small reply header to arrive
        with pytest.raises(SyncerError) as e:
            Learner(big(seed=1), GrpcTransport(proxy.address, stall_timeout=5.0), "second")
        message = str(e.value)
        assert time.monotonic() - started < 30  # well before the first chunk could have arrived
        assert message.startswith(f"join stalled: no data from the syncer at {proxy.address} for 5 s after 0.0 of 26.")
        assert "the link is too slow or down (raise stall_timeout / --stall-timeout)" in message
        assert "diloco syncer" not in message and "start" not in message
        first.close()


def test_a_stalled_upload_of_the_initial_model_says_the_link_is_slow():
    with syncer_and_proxy(bandwidth_bps=50e3) as (syncer, proxy):
        started = time.monotonic()
        with pytest.raises(SyncerError) as e:  # 5 s: room for a loaded syncer to answer the join that precedes it
            Learner(big(), GrpcTransport(proxy.address, stall_timeout=5.0), "first")
        message = str(e.value)
        assert time.monotonic() - started < 30  # a few attempts at most, each far from the 26 MB's 520 s
        # the proxy's queue is over a minute deep at 50 kB/s: the kernel may end the connection (TCP_USER_TIMEOUT)
        # before the watchdog; an attempt started over gets no further, so the upload as a whole stalls either way
        assert (message.startswith(f"init stalled: nothing moved to or from the syncer at {proxy.address} for 5 s")
                or message.startswith(f"init stalled: the upload of the initial model to the syncer at "
                                      f"{proxy.address} got no further than ")), message
        assert "of 26." in message and "MB" in message
        assert "too slow or down" in message and "diloco syncer" not in message


def test_an_upload_that_a_flaky_link_breaks_every_time_ends_saying_so_instead_of_starting_over_for_ever():
    # 26 MB at 1 MB/s needs 26 s; the link breaks every 2 s, so every attempt starts over and none can finish
    with syncer_and_proxy(bandwidth_bps=1e6, drop_every_seconds=2.0) as (syncer, proxy):
        started = time.monotonic()
        with pytest.raises(SyncerError) as e:
            Learner(big(), GrpcTransport(proxy.address, stall_timeout=3.0), "first")
        assert time.monotonic() - started < 60
        message = str(e.value)
        assert message.startswith(f"init stalled: the upload of the initial model to the syncer at {proxy.address} "
                                  f"got no further than "), message
        assert " of 26.2 MB in 3 s; its connection broke " in message and "started over each time" in message
        assert proxy.proxy.drops >= 2


def test_a_join_whose_download_breaks_part_way_starts_over_after_its_connect_timeout_has_passed():
    # 26 MB at 2 MB/s takes 13 s, far past the 2 s connect timeout: a break part-way is no reason to give up
    with syncer_and_proxy(bandwidth_bps=2e6) as (syncer, proxy):
        first = Learner(big(), GrpcTransport(syncer.address), "first")  # initialises the syncer, at loopback speed
        size = model_bytes(first.model)

        def drop_once():
            wait_for(lambda: proxy.bytes_down > size / 3, timeout=120)
            proxy.drop_connections()

        dropper = threading.Thread(target=drop_once, daemon=True)
        dropper.start()
        model = big(seed=1)
        second = Learner(model, GrpcTransport(proxy.address, connect_timeout=2.0, stall_timeout=10.0), "second")
        dropper.join()
        assert proxy.proxy.drops == 1 and proxy.bytes_down > size * 4 / 3
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), first.model.parameters()))
        second.close()
        first.close()


def test_a_join_that_a_flaky_link_breaks_every_time_ends_saying_so():
    with syncer_and_proxy(bandwidth_bps=1e6) as (syncer, proxy):
        first = Learner(big(), GrpcTransport(syncer.address), "first")
        proxy.set_faults(LinkFaults(bandwidth_bps=1e6, drop_every_seconds=2.0))
        started = time.monotonic()
        with pytest.raises(SyncerError) as e:
            Learner(big(seed=1), GrpcTransport(proxy.address, stall_timeout=3.0), "second")
        assert time.monotonic() - started < 60
        message = str(e.value)
        assert message.startswith(f"join stalled: the download of the model from the syncer at {proxy.address} got "
                                  f"no further than "), message
        assert " of 26.2 MB in 3 s; its connection broke " in message and "started over each time" in message
        first.close()


def joined_small(proxy, **transport):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 256))
    return model, Learner(model, GrpcTransport(proxy.address, **transport), "a")


@pytest.mark.parametrize("timeout", [2.0, None])
def test_finish_raises_naming_pushes_it_could_not_deliver(timeout):
    with syncer_and_proxy(fragments=2, sync_every=4) as (syncer, proxy):
        model, learner = joined_small(proxy, stall_timeout=1.0)
        proxy.partition(60)  # the syncer is out of reach from now on
        train(learner, model, 4)  # one push per fragment, neither answered
        assert learner.transport.undelivered == 2
        started = time.monotonic()
        with pytest.raises(SyncerError) as e:
            learner.transport.close(timeout)
        waited = time.monotonic() - started
        assert 1.0 <= waited < 15
        within = "within 2 s" if timeout else "(nothing moved for 1 s)"
        assert str(e.value).startswith(f"finish: 2 pushes not delivered {within} (fragments [1, 0]); the syncer is "
                                       f"unreachable or the link is too slow")
        learner.transport.close(timeout)  # closing again does nothing


@pytest.mark.parametrize("timeout", [30.0, None])
def test_finish_returns_once_every_push_is_answered(timeout):
    with syncer_and_proxy(fragments=2, sync_every=4, latency_ms=50) as (syncer, proxy):
        model, learner = joined_small(proxy, stall_timeout=5.0)
        train(learner, model, 4)
        assert learner.transport.undelivered >= 1  # still on their way through the 50 ms link
        learner.transport.close(timeout)
        assert learner.transport.undelivered == 0
        wait_for(lambda: sum(syncer.status["versions"]) >= 2)  # both pushes merged


class Denied(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.PERMISSION_DENIED

    def details(self):
        return "pushes are not allowed here"


class RefusingPush:
    def future(self, chunks):
        raise Denied()


def test_finish_raises_at_once_when_the_sender_failed_for_good():
    with syncer_and_proxy(fragments=2, sync_every=4) as (syncer, proxy):
        model, learner = joined_small(proxy)
        learner.transport.stub.Push = RefusingPush()
        train(learner, model, 2)  # pushes fragment 1, which is refused for good
        wait_for(lambda: learner.transport.error is not None, timeout=10)
        started = time.monotonic()
        with pytest.raises(SyncerError) as e:
            learner.transport.close(30)
        assert time.monotonic() - started < 15  # nothing to wait for: the sender stopped
        assert str(e.value) == ("finish: 1 push not delivered (fragments [1]): push of fragment 1 failed: pushes are "
                                "not allowed here")
