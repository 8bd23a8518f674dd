"""Exit codes that tell a scheduler what to do (diloco/exits.py): 0 finished, 75 retry me, 78 and 2 do not retry;
the code also lands in $DILOCO_EXIT_FILE, where a torchrun job script reads its leader's."""

import json
import socket
import subprocess
import sys
from dataclasses import replace

import pytest

from diloco import exits
from diloco.cli import main
from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.run.local import TINY
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.train.train_config import TrainConfig
from diloco.train.loop import train_config_to_json
from diloco.train.model import build_model
from liveness import wait_for

pytestmark = pytest.mark.timeout(120)


def run(capsys, monkeypatch, tmp_path, *argv) -> tuple[int, str, int | None]:
    """(exit code, stderr, code written to $DILOCO_EXIT_FILE)."""
    exit_file = tmp_path / "exit-code"
    exit_file.unlink(missing_ok=True)
    monkeypatch.setenv(exits.EXIT_FILE_ENV, str(exit_file))
    monkeypatch.delenv("RANK", raising=False)
    code = main(list(argv))
    written = int(exit_file.read_text()) if exit_file.exists() else None
    return code, capsys.readouterr().err, written


def tiny_config(tmp_path, model=TINY):
    path = tmp_path / "train.json"
    path.write_text(train_config_to_json(replace(TrainConfig(), model=model, batch_size=2)))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_syncer_means_retry(capsys, monkeypatch, tmp_path):
    code, err, written = run(capsys, monkeypatch, tmp_path, "learner", "--syncer", f"127.0.0.1:{free_port()}",
                             "--id", "x", "--connect-timeout", "1", "--train-config", tiny_config(tmp_path))
    assert code == written == exits.RETRY == 75 and "cannot reach the syncer" in err


@pytest.fixture
def syncer():
    s = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                     ServerOptions(listen="127.0.0.1:0", http=None, token="right"))
    yield s
    s.stop()


def test_a_refused_token_means_do_not_retry(capsys, monkeypatch, tmp_path, syncer):
    code, err, written = run(capsys, monkeypatch, tmp_path, "learner", "--syncer", syncer.address, "--id", "x",
                             "--token", "wrong", "--train-config", tiny_config(tmp_path))
    assert code == written == exits.REFUSED == 78 and "wrong or missing run token" in err


def test_a_mismatched_model_means_do_not_retry(capsys, monkeypatch, tmp_path, syncer):
    other = replace(TINY, d_model=TINY.d_model * 2)
    first = Learner(build_model(other, 0), GrpcTransport(syncer.address, token="right"), "first")  # sets the model
    try:
        code, err, written = run(capsys, monkeypatch, tmp_path, "learner", "--syncer", syncer.address, "--id", "x",
                                 "--token", "right", "--train-config", tiny_config(tmp_path))
    finally:
        first.close()
    assert code == written == exits.REFUSED and "model mismatch" in err


def test_a_finished_learner_exits_0_and_says_so(capsys, monkeypatch, tmp_path, syncer):
    code, err, written = run(capsys, monkeypatch, tmp_path, "learner", "--syncer", syncer.address, "--id", "x",
                             "--token", "right", "--max-steps", "3", "--train-config", tiny_config(tmp_path))
    assert code == written == exits.FINISHED, err


def test_usage_errors_exit_2_and_a_busy_port_means_retry(capsys, monkeypatch, tmp_path):
    code, err, written = run(capsys, monkeypatch, tmp_path, "syncer", "--initial-model", str(tmp_path / "none.st"))
    assert code == written == exits.USAGE and "no such file" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.chdir(tmp_path)
        code, err, written = run(capsys, monkeypatch, tmp_path, "syncer", "--listen", f"127.0.0.1:{port}",
                                 "--http", "127.0.0.1:0")
    assert code == written == exits.RETRY and "cannot listen" in err
    assert not list((tmp_path / "runs").iterdir())  # no empty default state folder left behind


@pytest.fixture
def syncer_process(tmp_path):
    """A `diloco syncer` process serving on ports it picked: (its ready.json, the argv of another syncer)."""
    def argv(state, listen="127.0.0.1:0", http="127.0.0.1:0"):
        return [sys.executable, "-m", "diloco", "syncer", "--listen", listen, "--http", http, "--state", str(state)]

    proc = subprocess.Popen(argv(tmp_path / "first"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ready = tmp_path / "first" / "ready.json"
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, "the first syncer ended"
        yield json.loads(ready.read_text()), argv
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("port", ["grpc", "http"])
def test_a_second_syncer_on_a_busy_port_exits_75_naming_it(tmp_path, syncer_process, port):
    # finding: gRPC's SO_REUSEPORT let a second syncer listen on the first's port, splitting the learners between
    # two runs; a busy HTTP port printed [Errno 98] without the address, and a traceback
    ready, argv = syncer_process
    address = f"127.0.0.1:{ready[f'{port}_port']}"
    flags = {"listen": address} if port == "grpc" else {"http": address}
    second = subprocess.run(argv(tmp_path / "second", **flags), capture_output=True, text=True, timeout=120)
    assert second.returncode == exits.RETRY, second.stderr
    assert "Traceback" not in second.stderr and "Errno 98" not in second.stderr, second.stderr
    flag = "--listen" if port == "grpc" else "--http"
    assert (f"diloco syncer: error: cannot listen on {address} ({'gRPC' if port == 'grpc' else 'HTTP'}" in
            second.stderr and f"choose another {flag} port or stop the other process" in second.stderr)


def test_only_the_leader_of_a_torchrun_group_writes_the_exit_file(monkeypatch, tmp_path):
    monkeypatch.setenv(exits.EXIT_FILE_ENV, str(tmp_path / "code"))
    monkeypatch.setenv("RANK", "1")
    assert exits.record(75) == 75 and not (tmp_path / "code").exists()
    monkeypatch.setenv("RANK", "0")
    assert exits.record(78) == 78 and (tmp_path / "code").read_text() == "78\n"


def test_messages_are_classified_by_whether_retrying_can_help():
    assert exits.for_syncer_error("syncer at h:1 refused learner 'a': learner id 'a' is already live") == exits.RETRY
    assert exits.for_syncer_error("lost the connection to the syncer at h:1 while joining") == exits.RETRY
    assert exits.for_syncer_error("syncer at h:1 refused learner 'a': model mismatch (tensor #1 ...)") == exits.REFUSED
    assert exits.for_syncer_error("invalid learner id '../x': use 1-64 letters") == exits.REFUSED
