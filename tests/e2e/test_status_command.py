"""`diloco status ADDRESS`: any running syncer's learners, rounds, tokens and refusals in the terminal, once or as
JSON; an address where no syncer answers is one line and a non-zero exit."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from torch import nn

from diloco.cli import main
from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread

from liveness import wait_for


def net(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 16))


@pytest.fixture(scope="module")
def syncer():
    """A syncer with a round closed, learner "a" in it and a refused join."""
    s = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                     ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0"))
    model = net()
    learner = Learner(model, GrpcTransport(s.address), "a")
    optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
    for _ in range(8):
        x = torch.randint(0, 16, (4, 4))
        loss = nn.functional.cross_entropy(model(x), x.sum(1) % 16)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(16, loss=loss.item())
    with pytest.raises(SyncerError, match="model mismatch"):
        Learner(net(width=9), GrpcTransport(s.address, connect_timeout=5), "b")
    wait_for(lambda: s.status.get("rounds", 0) >= 1 and s.status.get("refusals"))
    yield s
    learner.finish()
    s.stop()


def test_once_prints_the_learners_rounds_tokens_and_refusals(syncer, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["status", f"127.0.0.1:{syncer.status['http_port']}", "--once"]) == 0
    out = capsys.readouterr().out
    assert "rounds " in out and "tokens " in out and "no budget" in out
    row = next(line for line in out.splitlines() if " a " in line)
    assert "live" in row
    assert "refusals: join: model mismatch 1" in out


def test_json_prints_the_status_itself(syncer, capsys):
    assert main(["status", f"http://127.0.0.1:{syncer.status['http_port']}/", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["rounds"] >= 1 and [x["id"] for x in status["learners"]] == ["a"]


def test_an_address_where_no_syncer_answers_is_one_line_and_a_non_zero_exit(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", f"127.0.0.1:{port}", "--once"]) != 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"diloco status: error: cannot reach a syncer at http://127.0.0.1:{port}/status")


def serve(body: bytes, hits: list) -> ThreadingHTTPServer:
    """An HTTP server answering every GET with `body`, appending to `hits` for each."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_view_refreshes_until_ctrl_c(syncer):
    hits = []
    server = serve(json.dumps(syncer.status).encode(), hits)
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "status", f"127.0.0.1:{server.server_address[1]}",
                             "--every", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        wait_for(lambda: len(hits) >= 3, timeout=120)  # refreshing
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.shutdown()
    assert proc.returncode == 0, err
    assert hits[0] == "/status" and "refusals: join: model mismatch 1" in out


def test_an_address_of_something_else_says_it_is_no_syncer(capsys):
    server = serve(b'{"hello": "world"}', [])
    try:
        assert main(["status", f"127.0.0.1:{server.server_address[1]}", "--once"]) != 0
    finally:
        server.shutdown()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("answered, but not as a diloco syncer's /status")


def test_the_syncers_grpc_port_is_named_as_not_its_http_one(syncer, capsys):
    assert main(["status", f"127.0.0.1:{syncer.status['grpc_port']}", "--once"]) != 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "does not answer HTTP: give the syncer's HTTP address" in line
