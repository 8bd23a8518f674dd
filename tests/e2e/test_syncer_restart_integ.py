"""A syncer killed with SIGKILL and restarted on its state directory: nothing published is lost, learners go on."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from torch import nn

from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
STEPS = 1200  # about 15 s of training: the kill comes at 2 s and the restart about 4 s later


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def started():
    """Every process the test starts, killed at its end whatever happened: a failing test leaks nothing."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def start_syncer(port, state, started):
    ready = state / "ready.json"
    ready.unlink(missing_ok=True)
    log = (state.parent / "syncer.log").open("a")
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "--log-level", "INFO", "syncer", "--listen",
                             f"127.0.0.1:{port}", "--http", "127.0.0.1:0", "--state", str(state), "--learners", "2",
                             "--fragments", "2", "--sync-every", "4"], stdout=log, stderr=subprocess.STDOUT)
    started.append(proc)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "syncer did not start"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def status(info):
    with urllib.request.urlopen(f"http://127.0.0.1:{info['http_port']}/status", timeout=5) as r:
        return json.loads(r.read())


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 8), nn.Flatten(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))


@pytest.fixture
def training():
    """The test's training threads and the event that ends them: set at the test's end, so a failing test's threads
    stop instead of running on into the interpreter's shutdown."""
    stop, threads = threading.Event(), []
    yield stop, threads
    stop.set()
    for t in threads:
        t.join(60)


def train(learner_id, address, steps, out, stop):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    learner = Learner(model, GrpcTransport(address, connect_timeout=30), learner_id)
    g = torch.Generator().manual_seed(len(learner_id))
    for _ in range(steps):
        if stop.is_set():
            learner.close()
            return
        x = torch.randint(0, 32, (8, 4), generator=g)
        loss = nn.functional.cross_entropy(model(x), x.sum(1) % 32)
        opt.zero_grad()
        loss.backward()
        opt.step()
        learner.step(32, loss=loss.item())
        time.sleep(0.01)
    learner.finish()
    out[learner_id] = learner


def test_syncer_sigkill_and_restart_loses_no_published_round(tmp_path, started, training):
    port, state = free_port(), tmp_path / "syncer"
    proc, info = start_syncer(port, state, started)
    done, (stop, threads) = {}, training
    threads += [threading.Thread(target=train, args=(i, f"127.0.0.1:{port}", STEPS, done, stop), daemon=True)
                for i in ("a", "b")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # rounds merged before the kill (joining is slow on a loaded machine)
    while (before := status(info))["rounds"] < 3:
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), "no rounds before the kill"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1.5)  # learners keep training while the syncer is away
    proc, info = start_syncer(port, state, started)
    try:
        restored = status(info)
        # durable before published: everything any learner could have seen is still there
        assert restored["rounds"] >= before["rounds"]
        assert all(r >= b for r, b in zip(restored["versions"], before["versions"]))
        merged_before = {x["id"]: x["tokens_merged"] for x in before["learners"]}
        assert all(x["tokens_merged"] >= merged_before[x["id"]] for x in restored["learners"])
        for t in threads:
            t.join(120)
        assert sorted(done) == ["a", "b"] and all(d.step_count == STEPS for d in done.values())
        after = status(info)
        assert all(a > r for a, r in zip(after["versions"], restored["versions"]))  # the run went on
        assert all(d.transport.error is None for d in done.values())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    final = json.loads((state / "syncer.json").read_text())
    assert final["rounds"] >= after["rounds"]
