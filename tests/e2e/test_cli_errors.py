"""Bad input gets one clear line and exit code 2, never a traceback or a hang."""

import socket

import pytest

from diloco.cli import main
from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from fakes import TinyNet


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(list(argv)))
    out = capsys.readouterr()
    return e.value.code, out.err


@pytest.mark.parametrize("argv, message", [
    (["run", "--mode", "sideways"], "invalid choice: 'sideways'"),
    (["run", "--codec", "int3"], "invalid choice: 'int3'"),
    (["run", "--quorum", "5", "--learners", "4"], "--quorum 5 is more than the 4 learners"),
    (["run", "--fragments", "500"], "cannot split this model into 500 fragments"),
    (["run", "--speeds", "1,2", "--learners", "2"], "speed factors must be in (0, 1]"),
    (["run", "--speeds", "1,1", "--learners", "3"], "lists 2 factors for 3 learners"),
    (["run", "--learners", "0"], "--learners must be at least 1"),
    (["run", "--steps", "-3"], "--steps must be positive"),
    (["learner", "--syncer", "nohost", "--id", "x"], "expected HOST:PORT"),
    (["compare", "--modes", "decoupled,sideways"], "unknown mode 'sideways' in --modes"),
    (["run", "--mode", "dp", "--chaos", "syncer-crash"], "data-parallel runs have no syncer link"),
    (["run", "--chaos", "random", "--mtbf", "0"], "--mtbf must be positive"),
    (["run", "--lr-decay", "1.5"], "--lr-decay must be between 0 and 1"),
    (["run", "--warmup-steps", "-1"], "--warmup-steps must be 0 or more"),
    (["run", "--z-loss", "nan"], "--z-loss must be 0 or a positive number"),
    (["run", "--pace", "-1"], "--pace must be a positive number of seconds, auto or off"),
    (["run", "--syncer-shards", "0"], "--syncer-shards must be at least 1"),
    (["run", "--syncer-shards", "2", "--split-tensors"], "--split-tensors cannot be used with --syncer-shards"),
    (["syncer", "--shard", "1/2", "--split-tensors"], "--split-tensors cannot be used with --shard"),
    (["run", "--mode", "dp", "--initial-model", "file"], "--initial-model file applies to runs with a syncer"),
    (["run", "--syncer-shards", "2", "--chaos", "syncer-crash"], "take one syncer; drop --syncer-shards"),
    (["run", "--publish-to", "live"], "--publish-to live needs --down-codec fp32"),
    (["syncer", "--shard", "2/2"], "need 0 ≤ I < N"),
    (["syncer", "--listen", "127.0.0.1:0", "--initial-model", "/nonexistent/ckpt.safetensors"],
     "--initial-model /nonexistent/ckpt.safetensors: no such file"),
    (["learner", "--syncer", "127.0.0.1:1,nohost", "--id", "x"], "expected HOST:PORT, got 'nohost'"),
])
def test_bad_flags_are_refused_clearly(capsys, tmp_path, argv, message):
    code, err = run_cli(capsys, *argv, "--out", str(tmp_path / "run")) if argv[0] == "run" else run_cli(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_syncer_retries_then_says_what_to_do(capsys):
    code, err = run_cli(capsys, "learner", "--syncer", f"127.0.0.1:{closed_port()}", "--id", "x", "--connect-timeout", "1.5")
    assert code == 75  # EX_TEMPFAIL: retrying later may succeed (diloco/exits.py)
    assert "cannot reach the syncer" in err and "attempts" in err and "diloco syncer --listen" in err


def test_model_mismatch_over_grpc_names_the_first_differing_tensor():
    syncer = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4), ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        first = Learner(TinyNet(3), GrpcTransport(syncer.address), "a")
        with pytest.raises(SyncerError, match=r"model mismatch \(tensor #1: expected lin.weight \[3, 4\] float32, got lin.weight \[5, 4\]"):
            Learner(TinyNet(5), GrpcTransport(syncer.address, connect_timeout=5), "b")
        first.close()
    finally:
        syncer.stop()


def test_syncer_beyond_loopback_requires_a_token(capsys):
    code, err = run_cli(capsys, "syncer", "--listen", "0.0.0.0:0", "--http", "127.0.0.1:0")
    assert code == 2 and "needs secrets: pass --credentials (a token per learner) or --token" in err


def test_syncer_refuses_a_shared_token_beside_a_credentials_file(capsys, tmp_path):
    # finding: with both, every holder of the shared token could add ids, with no warning
    from diloco.syncer.defences import credentials
    path = tmp_path / "learners.toml"
    credentials.add(path, "site-a")
    code, err = run_cli(capsys, "syncer", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state",
                        str(tmp_path / "state"), "--token", "shared", "--credentials", str(path))
    assert code == 2 and "--token and --credentials together" in err and "drop --token" in err
    assert "Traceback" not in err


def test_syncer_refuses_a_credentials_file_giving_two_ids_one_token(capsys, tmp_path):
    path = tmp_path / "learners.toml"
    value = "0" * 64
    path.write_text(f'[learners.site-a]\ntoken_sha256 = "{value}"\n[learners.site-b]\ntoken_sha256 = "{value}"\n')
    code, err = run_cli(capsys, "syncer", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state",
                        str(tmp_path / "state"), "--credentials", str(path))
    assert code == 2 and "[learners.site-a] and [learners.site-b] have the same token_sha256" in err
    assert "Traceback" not in err
