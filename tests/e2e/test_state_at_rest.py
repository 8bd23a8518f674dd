"""The syncer's state at rest, against whoever can read or write its folder but does not hold its key: files for
its user alone, no session secret on disk, a signed manifest (forged, swapped and rolled-back states refused), and
a full disk that neither floods the log nor fails the exit once the final model is saved somewhere."""

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from diloco import atomic, exits

from diloco.cli import main
from diloco.config import for_mode
from diloco.algorithm.fragments import TensorSpec, plan_fragments, tensor_specs
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.syncer.core import Refused
from diloco.syncer.serving.server import ModelNotSaved, ServerOptions, SyncerThread
from diloco.syncer.at_rest.store import MANIFEST, PREVIOUS, StateError, StateStore, key_path
from diloco.syncer.observation.tape import Tape
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import specs_to_proto
from fakes import push_value, stored_core

SPECS = [TensorSpec("emb", (4, 2), "float32", True), TensorSpec("w1", (3, 2), "float32"), TensorSpec("w2", (5,), "float32")]


def make_core(folder, recover=False, accept_rollback=False, accept_unsigned=False, key=None, **overrides):
    return stored_core(StateStore(folder, recover=recover, key=key, accept_rollback=accept_rollback,
                                  accept_unsigned=accept_unsigned), **overrides)


def run(folder, rounds=3, **overrides):
    """A core that initialised and closed `rounds` rounds of fragment 1 (one generation per round)."""
    core = make_core(folder, **overrides)
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    session = core.join("a", SPECS)
    for seq in range(1, rounds + 1):
        assert push_value(core, "a", session, seq).accepted
        assert core.poll()
    return core, session


def manifest(folder, name=MANIFEST):
    return json.loads((folder / name).read_text())


def rehash(folder, name):
    """A forger without the key: the file's new size and SHA-256 recorded in the manifest, the signature left."""
    m = manifest(folder)
    data = (folder / name).read_bytes()
    m["integrity"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    (folder / MANIFEST).write_text(json.dumps(m))


def refused(folder, **kwargs) -> str:
    with pytest.raises(StateError) as e:
        make_core(folder, **kwargs).restore()
    return str(e.value)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---- files for the syncer's user alone ---------------------------------------------------------------------------
@pytest.fixture
def open_umask():
    """A umask that would leave new files readable by everyone: the modes must come from the syncer itself."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_every_file_the_syncer_writes_is_0600_and_its_folders_0700(tmp_path, open_umask):
    out = tmp_path / "out"
    cfg = for_mode("decoupled", 1, fragments=3, sync_every=6, codec="fp32", grace=0.0)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=out, snapshot_seconds=0.1))
    try:
        core = syncer.service.core
        flats = [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)]
        assert syncer.service._pool.submit(core.initialize, SPECS, flats).result()
        session = syncer.service._pool.submit(core.join, "a", SPECS).result()
        for seq in (1, 2):
            assert syncer.service._pool.submit(push_value, core, "a", session, seq).result().accepted
            deadline = time.monotonic() + 20
            while core.fragments[1].version < seq and time.monotonic() < deadline:
                time.sleep(0.05)
        deadline = time.monotonic() + 20
        while not any((out / "snapshots").glob("*.safetensors")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        syncer.stop()
    folders = [out, out / "state", out / "snapshots"]
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.relative_to(out).as_posix() for p in files}
    assert {"state.key", "state.generation", "tape.jsonl", "ready.json", "model.safetensors", "syncer.json",
            "state/manifest.json", "state/manifest.prev.json", "state/rounds.jsonl"} <= names
    assert any(n.startswith("state/fragment-") for n in names) and any(n.startswith("snapshots/") for n in names)
    assert {str(p): oct(mode(p)) for p in folders} == {str(p): oct(0o700) for p in folders}
    assert {str(p): oct(mode(p)) for p in files} == {str(p): oct(0o600) for p in files}


def test_an_existing_open_state_folder_is_tightened_at_start_with_a_log_line(tmp_path, caplog):
    run(tmp_path / "out" / "state")
    os.chmod(tmp_path / "out", 0o755)
    os.chmod(tmp_path / "out" / "state", 0o775)
    cfg = for_mode("decoupled", 2, fragments=3, sync_every=6, codec="fp32", grace=0.0)
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / "out")).stop()
    assert mode(tmp_path / "out") == 0o700 and mode(tmp_path / "out" / "state") == 0o700
    assert f"{tmp_path / 'out' / 'state'} was open to group or others (mode 775): tightened to 700" in caplog.text


def test_a_leftover_temporary_file_someone_holds_open_never_sees_the_new_contents(tmp_path, open_umask):
    tmp = tmp_path / "ledger-1.json.tmp"
    tmp.write_bytes(b"old")
    os.chmod(tmp, 0o666)
    with open(tmp, "rb") as held:  # opened by another user while it was readable
        atomic.write_json(tmp_path / "ledger-1.json", {"secret": "x"})
        assert held.read() == b"old"
    assert mode(tmp_path / "ledger-1.json") == 0o600


# ---- session secrets never at rest ---------------------------------------------------------------------------------
def state_bytes(folder) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())


def test_no_session_secret_is_saved_and_a_restarted_syncer_still_accepts_the_learner(tmp_path):
    core, session = run(tmp_path / "state")
    other = core.join("b", SPECS)
    assert push_value(core, "b", other, 1, fragment=2).accepted and core.poll()
    saved = state_bytes(tmp_path / "state")
    assert session.encode() not in saved and other.encode() not in saved
    restarted = make_core(tmp_path / "state")
    assert restarted.restore()
    assert restarted.learners["a"].session == ""  # not known until the learner presents it
    with pytest.raises(Refused, match="wrong session"):
        restarted.heartbeat("a", other)
    restarted.heartbeat("a", session)  # authenticated by its hash
    # pushes merged before the restart are recognised by the session's hash: merged at most once
    assert push_value(restarted, "a", session, 3).duplicate
    assert push_value(restarted, "a", session, 4).accepted and restarted.poll()
    assert session.encode() not in state_bytes(tmp_path / "state")
    again = make_core(tmp_path / "state")
    assert again.restore() and push_value(again, "a", session, 4).duplicate  # the new merge, saved by hash too


def test_a_ledger_saved_with_secrets_in_it_is_read_and_rewritten_without_them(tmp_path):
    state = tmp_path / "state"
    core, session = run(state)
    name = manifest(state)["files"]["ledger"]
    ledger = json.loads((state / name).read_text())
    for record in ledger["learners"]:  # as an older version saved it
        record["session"] = session
        del record["session_hash"]
        record["merged_seq"] = {f"{session}:1": 3}
    (state / name).write_text(json.dumps(ledger))
    m = manifest(state)
    data = (state / name).read_bytes()
    m["integrity"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    (state / MANIFEST).write_text(json.dumps(StateStore(state).key.sign(m)))  # the syncer's own older write
    restarted = make_core(state)
    assert restarted.restore()
    assert push_value(restarted, "a", session, 3).duplicate
    for seq in (4, 5):  # the old ledger stays as the previous generation until a second save replaces it
        assert push_value(restarted, "a", session, seq).accepted and restarted.poll()
    assert session.encode() not in state_bytes(state)


def test_a_restarted_syncer_takes_the_learners_session_over_grpc(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(8, 4)
            self.lin = nn.Linear(4, 4)

    cfg = for_mode("decoupled", 2, fragments=2, sync_every=4)
    opts = ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / "out")
    syncer = SyncerThread(cfg, opts)
    try:
        Learner(Net(), GrpcTransport(syncer.address), "first").close()
        request = pb.JoinRequest(learner_id="m", specs=specs_to_proto(tensor_specs(Net())))
        session = list(pb_grpc.SyncerStub(grpc.insecure_channel(syncer.address)).Join(request, timeout=10))[0].header.session
    finally:
        syncer.stop()
    assert session.encode() not in state_bytes(tmp_path / "out" / "state")
    syncer = SyncerThread(cfg, opts)
    try:
        stub = pb_grpc.SyncerStub(grpc.insecure_channel(syncer.address))
        assert not stub.Heartbeat(pb.HeartbeatRequest(learner_id="m", session=session), timeout=10).stop
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.HeartbeatRequest(learner_id="m", session="0" * 22), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        updates = stub.Subscribe(pb.SubscribeRequest(learner_id="m", session=session))  # its update stream, open
        deadline = time.monotonic() + 30
        while syncer.service._live_for("m") is None:
            assert time.monotonic() < deadline, "the restored learner's stream does not make it live"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:  # so its id cannot be taken without its secret
            list(stub.Join(request, timeout=10))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        updates.cancel()
    finally:
        syncer.stop()


# ---- a signed manifest and a monotonic generation -------------------------------------------------------------------
SIGNATURE = "its signature does not match the state key"


def test_garbage_finite_values_with_recomputed_hashes_are_refused(tmp_path):
    run(tmp_path)
    name = manifest(tmp_path)["files"]["fragment-1"]
    tensors = load_file(str(tmp_path / name))
    tensors["theta"] = torch.full_like(tensors["theta"], 1e6)  # finite, the right shape: only the key tells
    save_file(tensors, str(tmp_path / name))
    rehash(tmp_path, name)
    text = refused(tmp_path)
    assert f"{tmp_path / MANIFEST} is damaged ({SIGNATURE} {key_path(tmp_path)}: the state was changed outside" in text


def test_a_fragment_file_swapped_for_an_older_one_of_the_same_size_is_refused(tmp_path):
    run(tmp_path)
    newest, previous = manifest(tmp_path)["files"]["fragment-1"], manifest(tmp_path, PREVIOUS)["files"]["fragment-1"]
    assert newest != previous and (tmp_path / newest).stat().st_size == (tmp_path / previous).stat().st_size
    shutil.copyfile(tmp_path / previous, tmp_path / newest)
    rehash(tmp_path, newest)
    assert SIGNATURE in refused(tmp_path)


def test_a_changed_configuration_is_refused_not_adopted(tmp_path):
    run(tmp_path)
    name = manifest(tmp_path)["files"]["ledger"]
    ledger = json.loads((tmp_path / name).read_text())
    ledger["config"]["outer_lr"] = 50.0
    (tmp_path / name).write_text(json.dumps(ledger))
    rehash(tmp_path, name)
    assert SIGNATURE in refused(tmp_path)


def test_an_unsigned_manifest_is_refused_once_the_syncer_has_a_key(tmp_path):
    run(tmp_path)
    m = manifest(tmp_path)
    del m["hmac"]
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    assert "manifest.json is damaged (not signed, though every manifest this syncer writes is signed" in refused(tmp_path)


def test_a_missing_key_is_named_not_replaced(tmp_path):
    run(tmp_path / "state")
    key_path(tmp_path / "state").unlink()
    text = refused(tmp_path / "state")
    assert f"but the key {tmp_path / 'state.key'} is missing: put back the key file" in text
    assert not key_path(tmp_path / "state").exists()  # no new key made that would orphan the state


def test_a_key_readable_by_others_is_tightened_and_a_damaged_key_named(tmp_path, caplog):
    run(tmp_path / "state")
    key = key_path(tmp_path / "state")
    os.chmod(key, 0o644)
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        assert make_core(tmp_path / "state").restore()
    assert mode(key) == 0o600 and f"the state key {key} was readable by group or others (mode 644)" in caplog.text
    key.write_bytes(b"short")
    assert f"the state key {key} holds 5 bytes, not 32: restore it" in refused(tmp_path / "state")


def test_the_previous_generation_served_as_the_newest_is_a_rollback(tmp_path):
    core, _ = run(tmp_path)
    newest = manifest(tmp_path)["generation"]
    shutil.copyfile(tmp_path / PREVIOUS, tmp_path / MANIFEST)  # genuinely signed, one generation old
    text = refused(tmp_path)
    assert (f"the state folder {tmp_path} holds generation {newest - 1} but this syncer last wrote {newest}: it was "
            f"rolled back") in text and "pass --accept-rollback to resume from it" in text
    assert "rolled back" in refused(tmp_path, recover=True)  # --state-recover is for damage, not for this
    accepted = make_core(tmp_path, accept_rollback=True)
    assert accepted.restore() and accepted.fragments[1].version == core.fragments[1].version - 1


def test_an_older_copy_of_the_whole_folder_is_a_rollback(tmp_path):
    state = tmp_path / "state"
    core, session = run(state, rounds=2)
    shutil.copytree(state, tmp_path / "backup")
    for seq in (3, 4, 5):
        assert push_value(core, "a", session, seq).accepted and core.poll()
    shutil.rmtree(state)
    shutil.copytree(tmp_path / "backup", state)
    assert "holds generation 3 but this syncer last wrote 6" in refused(state)


def test_an_honest_restart_and_a_recovery_from_a_damaged_newest_generation_resume(tmp_path):
    core, session = run(tmp_path)
    restarted = make_core(tmp_path)
    assert restarted.restore() and restarted.fragments[1].version == core.fragments[1].version
    newest = manifest(tmp_path)
    (tmp_path / newest["files"]["fragment-1"]).write_bytes(b"torn")  # the newest exists but is damaged
    assert "--state-recover" in refused(tmp_path)
    recovered = make_core(tmp_path, recover=True)
    assert recovered.restore() and recovered.fragments[1].version == core.fragments[1].version - 1
    assert push_value(recovered, "a", session, 4).accepted and recovered.poll()
    assert make_core(tmp_path).restore()  # consistent and signed again


def contents(folder) -> dict:
    """Every file under `folder` and its bytes: a refusal must leave them as they were."""
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def strip_signature(folder, name):
    m = manifest(folder, name)
    del m["hmac"]
    (folder / name).write_text(json.dumps(m))


def test_a_signed_state_is_not_resumed_after_its_key_is_deleted_and_its_signature_stripped(tmp_path):
    # finding: whoever could delete files beside the state removed the key, dropped the manifest's signature and
    # edited the ledger (an outer lr of 100): the syncer resumed it with one warning
    state = tmp_path / "state"
    run(state)
    record = key_path(state).with_suffix(".generation")
    key_path(state).unlink()
    strip_signature(state, MANIFEST)
    name = manifest(state)["files"]["ledger"]
    ledger = json.loads((state / name).read_text())
    ledger["config"]["outer_lr"] = 100.0
    (state / name).write_text(json.dumps(ledger))
    rehash(state, name)
    before = contents(tmp_path)
    text = refused(state)
    assert (f"{state / MANIFEST} belongs to a state written with a state key (manifest.prev.json is signed; "
            f"{record} exists), but the key {key_path(state)} is missing") in text
    assert "a signed state is never resumed without its key" in text
    assert "without its key" in refused(state, accept_unsigned=True)  # that flag is for states from before keys
    assert contents(tmp_path) == before and not key_path(state).exists()  # nothing written, no new key


def test_a_state_stripped_of_every_trace_of_its_key_is_resumed_only_on_the_operators_word(tmp_path):
    state = tmp_path / "state"
    run(state)
    key_path(state).unlink()
    key_path(state).with_suffix(".generation").unlink()
    for name in (MANIFEST, PREVIOUS):
        strip_signature(state, name)
    before = contents(tmp_path)
    text = refused(state)
    assert f"{state / MANIFEST} is not signed and there is no state key {key_path(state)}" in text
    assert "pass --accept-unsigned" in text
    assert contents(tmp_path) == before


def test_a_deleted_generation_record_does_not_let_the_previous_manifest_pass(tmp_path):
    # finding: with state.generation deleted and manifest.prev.json put over manifest.json, the syncer resumed one
    # generation back without a word
    state = tmp_path / "state"
    core, session = run(state)
    newest = manifest(state)["generation"]
    record = key_path(state).with_suffix(".generation")
    record.unlink()
    shutil.copyfile(state / PREVIOUS, state / MANIFEST)  # genuinely signed, one generation old
    before = contents(tmp_path)
    text = refused(state)
    assert (f"the state folder {state} holds generation {newest - 1}, but the record of the newest generation this "
            f"syncer wrote, {record}, is missing") in text
    assert "put the record and the newest state back, or pass --accept-rollback to resume from it" in text
    assert "--accept-rollback" in refused(state, recover=True)
    assert contents(tmp_path) == before
    record.write_text(json.dumps({"generation": newest - 1}))  # nor is a record written without the key taken
    assert f"{record}, is not signed with the state key" in refused(state)
    accepted = make_core(state, accept_rollback=True)
    assert accepted.restore() and accepted.fragments[1].version == core.fragments[1].version - 1
    assert push_value(accepted, "a", session, 9).accepted and accepted.poll()  # saved again: resumed with no flag
    assert make_core(state).restore()


def test_the_other_manifest_names_the_newest_generation_when_the_record_is_gone(tmp_path):
    state = tmp_path / "state"
    run(state)
    newest = manifest(state)["generation"]
    newest_bytes, previous_bytes = (state / MANIFEST).read_bytes(), (state / PREVIOUS).read_bytes()
    (state / MANIFEST).write_bytes(previous_bytes)
    (state / PREVIOUS).write_bytes(newest_bytes)
    key_path(state).with_suffix(".generation").unlink()
    assert f"holds generation {newest - 1} but this syncer last wrote {newest}" in refused(state)


def test_a_key_kept_elsewhere_also_tells_a_whole_older_copy_of_the_folder(tmp_path):
    """Its record is kept beside it: nothing the folder's writers can delete or put back passes for the newest."""
    secrets, out = tmp_path / "secrets", tmp_path / "out"
    secrets.mkdir()
    key = secrets / "run.key"
    core, session = run(out / "state", rounds=3, key=key)
    assert not (out / "state.key").exists() and (secrets / "run.generation").exists()
    shutil.copytree(out, tmp_path / "old")  # all of --state at generation 4
    for seq in (4, 5):
        assert push_value(core, "a", session, seq).accepted and core.poll()
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "old", out)
    assert "holds generation 4 but this syncer last wrote 6" in refused(out / "state", key=key)
    key.unlink()  # and a signed state is not resumed without the key it names
    assert f"but the key {key} is missing" in refused(out / "state", key=key)


@pytest.mark.timeout(60)  # (before this was refused, the syncer served)
def test_a_rolled_back_state_stops_diloco_syncer_with_one_line_and_exit_2(tmp_path, capsys):
    run(tmp_path / "state")
    key_path(tmp_path / "state").with_suffix(".generation").unlink()
    shutil.copyfile(tmp_path / "state" / PREVIOUS, tmp_path / "state" / MANIFEST)
    before = contents(tmp_path)
    code = main(["syncer", "--state", str(tmp_path), "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("diloco syncer: error:")]
    assert code == exits.USAGE and "Traceback" not in err and len(lines) == 1, err
    assert "--accept-rollback" in lines[0]
    after = contents(tmp_path)
    after.pop(tmp_path / "syncer.lock", None)  # the folder's lock, held while the syncer ran
    assert after == before  # the state, its key and its record untouched


def test_a_state_from_before_keys_is_resumed_and_signed_by_the_next_save(tmp_path, caplog):
    state = tmp_path / "state"
    core, session = run(state)
    key_path(state).unlink()
    key_path(state).with_suffix(".generation").unlink()
    for name in (MANIFEST, PREVIOUS):
        m = manifest(state, name)
        del m["hmac"]
        (state / name).write_text(json.dumps(m))
    assert "pass --accept-unsigned" in refused(state)  # unsigned and keyless: only on the operator's word
    restarted = make_core(state, accept_unsigned=True)
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        assert restarted.restore()
    assert "written before state keys existed: resumed unauthenticated (--accept-unsigned)" in caplog.text
    assert push_value(restarted, "a", session, 4).accepted and restarted.poll()
    assert "hmac" in manifest(state) and key_path(state).exists()
    assert make_core(state).restore()


# ---- leftovers: a silent Init stream, a full disk, the exit status -------------------------------------------------
def silent_init(address, timeout):
    """An Init stream that sends nothing at all (no JoinRequest, no token), until the syncer ends it."""
    done = threading.Event()

    def nothing():
        done.wait(timeout)
        return
        yield

    started = time.monotonic()
    try:
        pb_grpc.SyncerStub(grpc.insecure_channel(address)).Init(nothing(), timeout=timeout)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    finally:
        done.set()
    return code, details, time.monotonic() - started


@pytest.mark.parametrize("initialised", [False, True])
def test_a_silent_init_stream_is_ended_after_one_stall_timeout(initialised):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    syncer = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None, stall_timeout=2.0))
    try:
        if initialised:
            Learner(Net(), GrpcTransport(syncer.address), "first").close()
        code, details, took = silent_init(syncer.address, timeout=60)
        # ten stall timeouts were 20 s; one is 2 s (the bound leaves room for a loaded machine)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "nothing arrived for 2 s" in details
        assert took < 15
    finally:
        syncer.stop()


def test_a_full_state_directory_is_logged_once_per_interval_with_a_count(tmp_path, monkeypatch, caplog):
    core, session = run(tmp_path, rounds=1)
    real = atomic.os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(atomic.os, "replace", full)
    (tmp_path / "rounds.jsonl").unlink()
    (tmp_path / "rounds.jsonl").symlink_to("/dev/full")  # appending the round history fails too
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        for seq in range(2, 42):
            assert push_value(core, "a", session, seq).accepted and core.poll()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 2, [r.getMessage() for r in errors]  # the state, the round history: once each
        assert "[Errno 28]" in core.state_error
        monkeypatch.setattr(atomic.os, "replace", real)
        core.persist([])
    assert core.state_error is None
    assert "takes writes again" in caplog.text and "39 failed writes were not logged" in caplog.text


def test_a_tape_on_a_full_disk_loses_events_quietly_and_closes(tmp_path, capfd, caplog):
    (tmp_path / "tape.jsonl").symlink_to("/dev/full")
    tape = Tape(tmp_path / "tape.jsonl")
    with caplog.at_level(logging.ERROR, logger="diloco.syncer"):
        for i in range(500):
            tape.record("round", fragment=i)
        tape.close()  # what is buffered cannot be written: logged, not raised
    assert len(caplog.records) == 1 and "cannot write the event tape" in caplog.text and "[Errno 28]" in caplog.text
    assert "Traceback" not in capfd.readouterr().err


def test_a_final_model_that_cannot_be_saved_anywhere_fails_the_syncer_naming_the_state(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))  # no fallback folder can be made
    out = tmp_path / "out"
    cfg = for_mode("decoupled", 1, fragments=3, sync_every=6, codec="fp32", grace=0.0)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=out))
    core = syncer.service.core
    flats = [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)]
    assert syncer.service._pool.submit(core.initialize, SPECS, flats).result()
    (out / "model.safetensors.tmp").mkdir()
    with pytest.raises(ModelNotSaved, match=rf"could not be saved in {out} nor in a fallback folder.*{out / 'state'}"):
        syncer.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 4)
        self.lin = nn.Linear(4, 16)

    def forward(self, x):
        return self.lin(self.emb(x))


FULL_DISK = """
import errno, os, runpy, sys
real, full = os.replace, sys.argv.pop(1)
def replace(src, dst, *args, **kwargs):  # every rename into the output folder fails as on a full disk
    if str(dst).startswith(full) and not str(dst).endswith("ready.json"):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))
    return real(src, dst, *args, **kwargs)
os.replace = replace
sys.argv[0] = "diloco"
runpy.run_module("diloco", run_name="__main__", alter_sys=True)
"""


@pytest.mark.timeout(180)
def test_sigterm_on_a_full_disk_exits_0_naming_the_fallback_model_without_flooding_the_log(tmp_path):
    out, fallback = tmp_path / "out", tmp_path / "fallback"
    state = out / "state"
    state.mkdir(parents=True)
    fallback.mkdir()
    (state / "rounds.jsonl").symlink_to("/dev/full")  # appends fail with ENOSPC
    (out / "tape.jsonl").symlink_to("/dev/full")
    (out / "snapshots").write_text("")  # nor can snapshots go anywhere
    port = free_port()
    log_path = tmp_path / "syncer.log"
    env = dict(os.environ, TMPDIR=str(fallback))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", FULL_DISK, str(out), "syncer", "--listen",
                                 f"127.0.0.1:{port}", "--http", "127.0.0.1:0", "--state", str(out), "--learners", "1",
                                 "--fragments", "2", "--sync-every", "4", "--snapshot-every", "0.2"],
                                stdout=subprocess.DEVNULL, stderr=log, env=env)
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 120
        while not (out / "ready.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        model = Small()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        learner = Learner(model, GrpcTransport(f"127.0.0.1:{port}", connect_timeout=30), "a")
        g = torch.Generator().manual_seed(0)
        for _ in range(160):  # about 80 rounds, each failing to write the state, the history and the tape
            x = torch.randint(0, 16, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), (x + 1) % 16)
            opt.zero_grad()
            loss.backward()
            opt.step()
            learner.step(8, loss=loss.item())
        learner.finish()
        assert learner.transport.error is None
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        periods = 1 + int((time.monotonic() - started) // 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = log_path.read_text().splitlines()
    assert code == 0, lines[-20:]
    assert "Traceback" not in "\n".join(lines) and "Logging error" not in "\n".join(lines)
    errors = [line for line in lines if " ERROR " in line]
    # five kinds of failure (state, round history, tape, snapshots, the dashboard's history.json), each logged once
    # per 30 s; five lines at shutdown (the last snapshot, the final model and syncer.json going to the fallback
    # folder)
    assert len(errors) <= 5 * periods + 5, errors
    saved = list(fallback.glob("diloco-final-*/model.safetensors"))
    assert len(saved) == 1 and set(load_file(str(saved[0]))) == {"emb.weight", "lin.weight", "lin.bias"}
    assert lines[-1].endswith(f"syncer stopped; the final model is {saved[0]} (a fallback folder: copy it somewhere safe)")
