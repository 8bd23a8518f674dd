"""The syncer's health probes for schedulers: /healthz (live) and /readyz (ready), open to every client and free
of secrets, while /status beyond loopback still needs a token."""

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch
from torch import nn

from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.syncer.serving.http import LIVE_WITHIN, http_server, probe
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.syncer.serving.service import SyncerService

from liveness import wait_for


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_probe_answers_live_and_ready_from_the_serving_loops_state():
    assert probe("/healthz", {}, {})[0] == 503  # the loop never turned
    import time

    assert probe("/healthz", {}, {"at": time.monotonic()})[0] == 200
    assert probe("/healthz", {}, {"at": time.monotonic() - LIVE_WITHIN - 1})[0] == 503  # a hung loop
    assert probe("/readyz", {}, {})[0] == 503  # not yet listening
    code, body = probe("/readyz", {"initialized": False, "stopping": False}, {})
    assert code == 200 and json.loads(body) == {"ready": True, "initialized": False, "stopping": False}
    assert probe("/readyz", {"initialized": True, "stopping": True}, {})[0] == 503  # the run is over
    assert probe("/status", {}, {}) is None


def test_a_running_syncer_is_live_and_ready_before_and_after_the_model_exists():
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4), ServerOptions(listen="127.0.0.1:0"))
    try:
        base = f"http://127.0.0.1:{syncer.status['http_port']}"
        assert get(base + "/healthz")[0] == 200
        code, body = get(base + "/readyz")
        assert code == 200 and json.loads(body)["initialized"] is False  # ready to accept the first join
        torch.manual_seed(0)
        learner = Learner(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4)), GrpcTransport(syncer.address), "a")
        wait_for(lambda: json.loads(get(base + "/readyz")[1])["initialized"])
        learner.finish()
    finally:
        syncer.stop()


def test_status_is_known_once_ready_json_says_where_to_ask(tmp_path, monkeypatch):
    """ready.json is written after the first status refresh, so a reader that asks /status at once gets it; before
    that refresh /status says 503 "starting", never an empty body."""
    original = SyncerService.status
    first = threading.Event()

    async def slow_first(self):
        if not first.is_set():  # a loaded machine: the first refresh is slow to come
            first.set()
            await asyncio.sleep(1.0)
        return await original(self)

    monkeypatch.setattr(SyncerService, "status", slow_first)
    answers = []

    def read_at_once():
        wait_for(lambda: (tmp_path / "s" / "ready.json").exists(), timeout=60, period=0.001)
        ready = json.loads((tmp_path / "s" / "ready.json").read_text())
        answers.append(get(f"http://127.0.0.1:{ready['http_port']}/status"))

    reader = threading.Thread(target=read_at_once)
    reader.start()
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", out=tmp_path / "s"))
    try:
        reader.join(60)
        code, body = answers[0]
        assert code == 200 and "rounds" in json.loads(body)
        assert get(f"http://127.0.0.1:{syncer.status['http_port']}/status")[0] == 200
    finally:
        syncer.stop()


def test_status_before_the_first_refresh_says_starting():
    server = http_server("127.0.0.1:0", None, {}, [""])  # serves from its own thread
    try:
        code, body = get(f"http://127.0.0.1:{server.server_address[1]}/status")
        assert code == 503 and json.loads(body) == {"starting": True}
    finally:
        server.shutdown()


def own_address() -> str | None:
    """This machine's address on its default route (not loopback), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_probes_need_no_token_beyond_loopback_while_status_does():
    address = own_address()
    if address is None:
        pytest.skip("this machine has no address beyond loopback to probe from")
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=f"{address}:0", token="run-secret",
                                        status_token="look"))
    try:
        base = f"http://{address}:{syncer.status['http_port']}"
        for path in ("/healthz", "/readyz"):
            code, body = get(base + path)
            assert code == 200 and b"secret" not in body and b"look" not in body
        assert get(base + "/status")[0] == 401
        assert get(base + "/metrics")[0] == 401
    finally:
        syncer.stop()
