"""The fault-injecting proxy: bytes pass unchanged and counted, faults slow or break the link as configured, and
a learner trains through it, even when its connections are reset mid-run."""

import argparse
import contextlib
import random
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode
from diloco.chaos import LinkFaults, ProxyThread
from diloco.chaos.proxy_command import parse_rate, register
from diloco.chaos.proxy import Lane, split_address

from liveness import wait_for


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        with contextlib.suppress(OSError):
            while data := self.request.recv(65536):
                self.request.sendall(data)


@pytest.fixture
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def proxy_to(target, **faults):
    proxy = ProxyThread(target, faults=LinkFaults(**faults), seed=1)
    try:
        yield proxy
    finally:
        proxy.stop()


def connect(address) -> socket.socket:
    s = socket.create_connection(split_address(address), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def receive(s: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n and (chunk := s.recv(n - len(data))):
        data += chunk
    return bytes(data)


def roundtrip(address, data: bytes) -> bytes:
    with connect(address) as s:
        sender = threading.Thread(target=s.sendall, args=(data,))
        sender.start()  # send and receive at once, so neither side's buffers have to hold everything
        got = receive(s, len(data))
        sender.join()
    return got


def is_closed(s: socket.socket) -> bool:
    """Whether the peer closed or reset the connection (a timeout raises: the test failed by hanging)."""
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True


def fails_or_closes(address) -> bool:
    """Whether a new connection is refused, reset while connecting, or closed right after."""
    try:
        s = connect(address)
    except ConnectionError:
        return True
    with s:
        return is_closed(s)


def test_bytes_pass_unchanged_and_are_counted_exactly(echo):
    big = random.Random(0).randbytes(1 << 20)
    with proxy_to(echo) as proxy:
        assert roundtrip(proxy.address, b"hello") == b"hello"
        assert roundtrip(proxy.address, big) == big
        assert proxy.bytes_up == proxy.bytes_down == len(big) + 5


def test_latency_delays_each_direction(echo):
    with proxy_to(echo, latency_ms=100) as proxy, connect(proxy.address) as s:
        start = time.monotonic()
        s.sendall(b"ping")
        assert receive(s, 4) == b"ping"
        assert time.monotonic() - start >= 0.19


def test_bandwidth_cap_paces_the_bytes(echo):
    with proxy_to(echo, bandwidth_bps=100_000) as proxy:
        start = time.monotonic()
        assert roundtrip(proxy.address, bytes(200_000)) == bytes(200_000)
        assert time.monotonic() - start >= 1.5


def test_jittered_release_times_never_go_backwards():
    lane, rng, faults = Lane(), random.Random(0), LinkFaults(latency_ms=5, jitter_ms=50)
    releases = [lane.plan(i * 0.001, 100, faults, rng)[1] for i in range(1000)]
    assert releases == sorted(releases)
    assert all(r >= i * 0.001 + 0.005 for i, r in enumerate(releases))


def test_jitter_never_reorders_bytes(echo):
    with proxy_to(echo, jitter_ms=20) as proxy, connect(proxy.address) as s:
        for i in range(200):
            s.sendall(struct.pack(">I", i))
            time.sleep(0.001)  # separate chunks, each with its own jitter
        got = receive(s, 800)
        assert list(struct.unpack(">200I", got)) == list(range(200))


def test_dropped_connections_close_and_new_ones_work(echo):
    with proxy_to(echo) as proxy, connect(proxy.address) as s:
        s.sendall(b"x")
        assert receive(s, 1) == b"x"
        proxy.drop_connections()
        assert is_closed(s)
        assert roundtrip(proxy.address, b"again") == b"again"


def test_partition_refuses_connections_until_it_ends(echo):
    with proxy_to(echo) as proxy, connect(proxy.address) as s:
        s.sendall(b"x")
        assert receive(s, 1) == b"x"
        proxy.partition(1.0)
        ends = time.monotonic() + 1.0
        assert is_closed(s)
        assert fails_or_closes(proxy.address)
        time.sleep(max(0.0, ends - time.monotonic()) + 0.1)
        assert roundtrip(proxy.address, b"healed") == b"healed"


def test_unreachable_target_closes_the_client():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with proxy_to(f"127.0.0.1:{port}") as proxy:
        assert fails_or_closes(proxy.address)  # within connect()'s timeout: a hang would raise


@pytest.mark.parametrize("text, rate", [("10mbit", 1_250_000), ("1gbit", 125_000_000), ("500kbit", 62_500),
                                        ("2MB", 2_000_000), ("64kb", 64_000), ("1000", 1000), ("1.5 Mbit", 187_500)])
def test_rates_parse_to_bytes_per_second(text, rate):
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["10mbps", "fast", "0", "-5mbit", "", "mbit"])
def test_bad_rates_are_refused_naming_the_value(text):
    with pytest.raises(ValueError, match=f"bad rate {text!r}"):
        parse_rate(text)


def parse(*argv):
    parser = argparse.ArgumentParser(prog="diloco")
    register(parser.add_subparsers())
    return parser.parse_args(["proxy", "--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", *argv])


def test_proxy_command_refuses_bad_settings_before_listening():
    for argv, message in [(["--bandwidth", "9 parsecs"], "'9 parsecs'"), (["--latency-ms", "-1"], "latency"),
                          (["--partition-at", "3"], "--partition-for")]:
        args = parse(*argv)
        with pytest.raises(ValueError, match=message):
            args.func(args)


@contextlib.contextmanager
def killed_at_the_end(process: subprocess.Popen):
    """Popen's own `with` waits for the process, which a failed assertion would leave running forever."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()


def test_proxy_command_partitions_reports_and_stops_on_sigterm(echo):
    script = ("import argparse, sys; from diloco.chaos import proxy_command as cli; cli.STATUS_SECONDS = 0.1; "
              "p = argparse.ArgumentParser(); cli.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); "
              "sys.exit(a.func(a))")
    command = [sys.executable, "-c", script, "proxy", "--listen", "127.0.0.1:0", "--target", echo, "--latency-ms", "5",
               "--partition-at", "0", "--partition-for", "0.3"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process, killed_at_the_end(process):
        first = process.stdout.readline()
        assert "latency 5 ms" in first
        address = first.split("listening on ")[1].split(",")[0]
        assert process.stdout.readline().startswith("partition: refusing connections for 0.3 s")
        while "connected" not in (line := process.stdout.readline()):  # status lines until the partition ends
            assert "PARTITIONED" in line
        assert roundtrip(address, b"through the command") == b"through the command"
        process.send_signal(signal.SIGTERM)
        rest = process.stdout.read()
        assert process.wait(10) == 0
    assert "forwarded 19 B up and 19 B down" in rest


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))


def train(learner, net, steps, on_step=lambda step: None):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        x = torch.randint(0, 8, (8,), generator=g)
        loss = nn.functional.cross_entropy(net(x), x % 4)
        opt.zero_grad()
        loss.backward()
        opt.step()
        learner.step(8, loss=loss.item())
        on_step(step)
        time.sleep(0.02)


@pytest.fixture
def syncer():
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4), ServerOptions(listen="127.0.0.1:0", http=None))
    yield syncer
    syncer.stop()


def test_learner_trains_through_the_proxy(syncer):
    with proxy_to(syncer.address, latency_ms=2) as proxy:
        net = model()
        learner = Learner(net, GrpcTransport(proxy.address), "a")
        train(learner, net, 12)
        learner.finish()
        status = syncer.stop()
        assert learner.transport.error is None
        assert status["rounds"] >= 2
        assert proxy.bytes_up > 0 and proxy.bytes_down > 0
        assert proxy.bytes_up + proxy.bytes_down >= status["wire_bytes"] > 0


def test_learner_survives_connections_dropped_mid_training(syncer):
    with proxy_to(syncer.address) as proxy:
        net = model()
        learner = Learner(net, GrpcTransport(proxy.address), "a")
        seen = {}

        def drop_in_the_middle(step):
            if step == 12:
                wait_for(lambda: syncer.status["rounds"] >= 2)  # the status is refreshed every 0.5 s
                seen.update(rounds=syncer.status["rounds"], bytes_up=proxy.bytes_up)
                proxy.drop_connections()

        train(learner, net, 24, drop_in_the_middle)
        learner.finish()
        status = syncer.stop()
        assert learner.transport.error is None
        assert status["rounds"] > seen["rounds"]  # pushes came through new connections
        assert proxy.bytes_up > seen["bytes_up"]
