"""Files read at start that someone else placed or changed (the state folder, history.json, --config,
--credentials, a checkpoint's diloco_learner.json): a FIFO, a link to /dev/zero, a huge or deeply nested file is
refused at once with a one-line reason; a required state file as damaged state, the optional history as a log
line while the syncer serves. Never a traceback, a crash loop or a syncer that never serves."""

import json
import logging
import os
import urllib.request

import pytest

from diloco import ServerOptions, SyncerThread, for_mode
from diloco.cli import main
from diloco.integrations import rejoin
from diloco.syncer.defences import credentials
from diloco.syncer.at_rest import history_file
from diloco.syncer.observation.history import History
from diloco.syncer.at_rest.store import MANIFEST, StateError, key_path
from syncers import trained_learner
from state_files import make_core, manifest, refused, rehash, run

pytestmark = pytest.mark.timeout(120)  # a file that blocked its reader would hang the test here

DEEP = "[" * 100_000 + "]" * 100_000


def hostile(path, kind: str) -> None:
    """Replace the file at `path` with a hostile one of `kind`."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes: a plain open for reading waits forever
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # endless: a plain read takes all memory
    elif kind == "nested":
        path.write_text(DEEP)
    else:
        raise AssertionError(kind)


# ---- the state folder ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, why", [("fifo", "not a regular file (a FIFO)"),
                                       ("dev-zero", "a symbolic link"),
                                       ("nested", "nested deeper than 64 levels")])
def test_a_hostile_manifest_is_damaged_state(tmp_path, kind, why):
    run(tmp_path)
    hostile(tmp_path / MANIFEST, kind)
    text = refused(tmp_path)
    assert f"{tmp_path / MANIFEST} is damaged ({why}" in text and "--state-recover" in text


def test_a_nested_ledger_is_damaged_state_even_when_signed(tmp_path):
    run(tmp_path)
    name = manifest(tmp_path)["files"]["ledger"]
    (tmp_path / name).write_text('{"a": ' + DEEP + "}")
    rehash(tmp_path, name)  # its hash and signature match: only its shape is wrong
    assert f"{tmp_path / name} is damaged (nested deeper than 64 levels)" in refused(tmp_path)


def test_a_hostile_state_key_is_refused_naming_it(tmp_path):
    run(tmp_path)
    hostile(key_path(tmp_path), "fifo")
    with pytest.raises(StateError, match=rf"the state key {key_path(tmp_path)} is not a regular file \(a FIFO\)"):
        make_core(tmp_path).restore()


def test_a_hostile_generation_record_is_refused_like_a_missing_one(tmp_path):
    """The record of the newest generation is what a rollback is told by: unreadable, it cannot tell one."""
    run(tmp_path)
    generation = key_path(tmp_path).with_suffix(".generation")
    hostile(generation, "fifo")  # beside the folder, like the key
    text = refused(tmp_path)
    assert f"{generation}, is unreadable (not a regular file (a FIFO))" in text and "--accept-rollback" in text
    core = make_core(tmp_path)
    core.store.accept_rollback = True
    assert core.restore() and core.rounds == 3


def test_a_hostile_round_history_is_set_aside(tmp_path, caplog):
    """The round history is not needed to resume."""
    run(tmp_path)
    hostile(tmp_path / "rounds.jsonl", "dev-zero")
    with caplog.at_level(logging.WARNING, "diloco.syncer"):
        core = make_core(tmp_path)
        assert core.restore() and core.rounds == 3
    assert "rounds.jsonl is not used: a symbolic link" in caplog.text
    (tmp_path / "rounds.jsonl").unlink(missing_ok=True)
    (tmp_path / "rounds.jsonl").write_text(f'{DEEP}\n[1.0, 1, "x", 1]\n7\n[2.0, 1, 1, 1]\n')
    core = make_core(tmp_path)
    assert core.restore() and list(core.round_log) == [(2.0, 1, 1, 1)]  # the bad lines are skipped


# ---- history.json: optional, set aside while the syncer serves ---------------------------------------------------
def status(syncer: SyncerThread) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{syncer.status['http_port']}/status", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("kind, why", [("fifo", "not a regular file (a FIFO)"), ("dev-zero", "a symbolic link"),
                                       ("nested", "nested deeper than 64 levels")])
def test_a_hostile_history_is_set_aside_and_the_syncer_serves(tmp_path, caplog, kind, why):
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4)
    options = ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0", out=tmp_path / "syncer")
    syncer = SyncerThread(cfg, options)
    try:
        trained_learner(syncer.address, "a", steps=8).close()
    finally:
        syncer.stop()
    path = tmp_path / "syncer" / "history.json"
    assert path.is_file()
    hostile(path, kind)
    with caplog.at_level(logging.INFO, "diloco.syncer"):
        syncer = SyncerThread(cfg, options)  # resumes the state: the history is read
        try:
            assert status(syncer)["initialized"] and status(syncer)["rounds"] > 0
        finally:
            syncer.stop()
    lines = [r.getMessage() for r in caplog.records if "charts start anew" in r.getMessage()]
    assert len(lines) == 1 and f"{path} cannot be read: {why}" in lines[0]


def test_an_oversized_history_is_set_aside(tmp_path, monkeypatch):
    (tmp_path / "history.json").write_text(json.dumps({"format": 1, "pad": "x" * 2000}))
    monkeypatch.setattr(history_file, "MAX_BYTES", 1024)
    problem = history_file.load(tmp_path / "history.json", History(), 1.0)
    assert problem == f"{tmp_path / 'history.json'} is larger than 1024 bytes"


# ---- files a person names: --config, --credentials, a checkpoint ------------------------------------------------
def one_line_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("kind, why", [("fifo", "not a regular file (a FIFO)"),
                                       ("dev-zero", "not a regular file (a device)"),
                                       ("nested", "nested deeper than 64 levels")])
def test_a_hostile_config_file_is_one_line(capsys, tmp_path, kind, why):
    path = tmp_path / "c.toml"
    if kind == "nested":
        path.write_text("learners = " + "[" * 5000)
    else:
        hostile(path, kind)  # a link is followed for a file a person names, but only to a regular file
    assert f"--config {path}: {why}" in one_line_error(capsys, "syncer", "--config", str(path))


def test_an_oversized_config_file_is_one_line(capsys, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("# " + "x" * (2 << 20) + "\n")
    assert f"--config {path}: larger than 1 MB" in one_line_error(capsys, "syncer", "--config", str(path))


@pytest.mark.parametrize("kind, why", [("fifo", "not a regular file (a FIFO)"),
                                       ("nested", "nested deeper than 64 levels")])
def test_a_hostile_train_config_is_one_line(capsys, monkeypatch, tmp_path, kind, why):
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "train.json"
    hostile(path, kind)
    assert f"--train-config {path}: {why}" in one_line_error(
        capsys, "learner", "--syncer", "127.0.0.1:1", "--id", "x", "--train-config", str(path))


@pytest.mark.parametrize("kind", ["fifo", "nested"])
def test_a_hostile_credentials_file_is_refused(tmp_path, kind):
    path = tmp_path / "learners.toml"
    if kind == "nested":
        path.write_text('[learners.a]\ntoken_sha256 = ' + "[" * 5000)
    else:
        hostile(path, kind)
    with pytest.raises(credentials.CredentialsError, match=rf"--credentials {path}: (not a regular file|nested)"):
        credentials.Credentials.load(path)


@pytest.mark.parametrize("kind, why", [("fifo", "not a regular file (a FIFO)"),
                                       ("dev-zero", "not a regular file (a device)"),
                                       ("nested", "nested deeper than 64 levels")])
def test_a_hostile_rejoin_record_is_refused(tmp_path, kind, why):
    hostile(tmp_path / rejoin.RECORD_FILE, kind)
    with pytest.raises(ValueError, match=rf"{rejoin.RECORD_FILE} is {why.replace('(', '.').replace(')', '.')}: "
                                         rf"delete it to join as a new learner"):
        rejoin.read(tmp_path)


# ---- files the syncer appends to ----------------------------------------------------------------------------
def test_a_fifo_in_place_of_an_appended_file_fails_at_once_instead_of_blocking(tmp_path, caplog):
    os.mkfifo(tmp_path / "tape.jsonl")  # nobody reads: a plain open for appending waits forever
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4)
    with pytest.raises(RuntimeError, match=r"did not start: cannot open the event tape .*tape\.jsonl: \[Errno 6\]"):
        SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path))
    core, _ = run(tmp_path / "state")
    (tmp_path / "state" / "rounds.jsonl").unlink()
    os.mkfifo(tmp_path / "state" / "rounds.jsonl")
    with caplog.at_level(logging.ERROR, "diloco.syncer"):
        core.store.append_round((1.0, 1, 4, 1))  # the round goes on; the line is lost, and logged
    assert "cannot append to" in caplog.text and "rounds.jsonl" in caplog.text
