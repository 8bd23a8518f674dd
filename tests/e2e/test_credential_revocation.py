"""A credential can be revoked while the syncer runs: the --credentials file is read again when it changes and on
SIGHUP, and a restart on the edited file checks the sessions it restores. A revoked id's session is closed at once,
its learner stops with an error that says so, and its contributions still in open rounds are not merged."""

import json
import logging
import os
import signal
import subprocess
import sys

import grpc
import pytest

from diloco import exits
from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.defences import credentials
from diloco.syncer.membership import Refused
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.wire import diloco_pb2 as pb
from liveness import wait_for
from rpc import join
from fakes import TinyNet as Net
from rpc import code_of, push_header, stub
from cores import SPECS, make_core, push

pytestmark = pytest.mark.timeout(300)
CFG = for_mode("decoupled", 2, fragments=2, sync_every=4)


@pytest.fixture
def creds(tmp_path):
    path = tmp_path / "learners.toml"
    return path, {lid: credentials.add(path, lid) for lid in ("site-a", "site-b", "site-c")}


def keep_only(path, *ids):
    """Rewrite the file with only `ids` (their tokens as they were): every other id is revoked."""
    digests = credentials.Credentials.load(path).digests
    path.write_text("".join(f'[learners."{lid}"]\ntoken_sha256 = "{digests[lid]}"\n' for lid in ids))


def heartbeat(address, learner_id, session):
    return code_of(lambda: stub(address).Heartbeat(pb.HeartbeatRequest(learner_id=learner_id, session=session),
                                                   timeout=10))


def subscribe(address, learner_id, session):
    return code_of(lambda: next(stub(address).Subscribe(pb.SubscribeRequest(learner_id=learner_id, session=session),
                                                        timeout=10)))


def test_an_id_removed_from_the_file_is_revoked_at_once_while_the_syncer_runs(creds):
    # finding: the file was read once at start; a token deleted from it still joined, heartbeated and pushed
    path, tokens = creds
    s = SyncerThread(CFG, ServerOptions(listen="127.0.0.1:0", http=None, credentials=path))
    learner = None
    try:
        Learner(Net(), GrpcTransport(s.address, token=tokens["site-b"]), "site-b").close()  # uploads the model
        learner = Learner(Net(), GrpcTransport(s.address, token=tokens["site-a"]), "site-a")
        _, session = join(s.address, "site-c", tokens["site-c"])
        assert heartbeat(s.address, "site-c", session)[0] == grpc.StatusCode.OK
        keep_only(path, "site-b")
        wait_for(lambda: heartbeat(s.address, "site-c", session)[0] != grpc.StatusCode.OK, timeout=30)
        code, details = heartbeat(s.address, "site-c", session)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "was revoked" in details
        header, _ = push_header("site-c", session, fragment=1)
        code, details = code_of(lambda: stub(s.address).Push(iter([pb.PushChunk(header=header)]), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "was revoked" in details
        code, details = subscribe(s.address, "site-c", session)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "was revoked" in details
        # the live learner stops with the reason, and does not retry
        wait_for(lambda: learner.transport.error is not None, timeout=30)
        with pytest.raises(SyncerError, match="credential of learner 'site-a' was revoked") as stopped:
            learner.transport.check()
        assert exits.for_error("learner", stopped.value) == exits.REFUSED  # a scheduler does not restart it
        wrapped = SyncerError(f"finish: 1 push not delivered (fragments [1]): {stopped.value}")
        assert exits.for_error("learner", wrapped) == exits.REFUSED
        code, details = join(s.address, "site-a", tokens["site-a"])  # a new join of the removed id
        assert code == grpc.StatusCode.UNAUTHENTICATED and "has no credential" in details
        assert join(s.address, "site-b", tokens["site-b"])[0] == grpc.StatusCode.OK  # the others are untouched
        assert s.service.core.learners["site-a"].revoked and "site-a" not in s.service.core.live()
    finally:
        if learner is not None:
            learner.close()
        s.stop()


def test_a_file_that_cannot_be_read_keeps_the_credentials_in_force(creds, caplog):
    path, tokens = creds
    caplog.set_level(logging.INFO, logger="diloco.syncer")
    s = SyncerThread(CFG, ServerOptions(listen="127.0.0.1:0", http=None, credentials=path))
    try:
        Learner(Net(), GrpcTransport(s.address, token=tokens["site-b"]), "site-b").close()
        _, session = join(s.address, "site-a", tokens["site-a"])
        path.write_text("[learners.site-a\n")  # an edit saved half-way
        wait_for(lambda: "credentials not reloaded (the file changed)" in caplog.text, timeout=30)
        assert "not valid TOML" in caplog.text
        assert heartbeat(s.address, "site-a", session)[0] == grpc.StatusCode.OK  # nothing revoked
        assert join(s.address, "guest", "")[0] == grpc.StatusCode.UNAUTHENTICATED  # and nothing opened
        path.unlink()
        wait_for(lambda: "cannot read it" in caplog.text, timeout=30)
        assert heartbeat(s.address, "site-a", session)[0] == grpc.StatusCode.OK
        keep_only_text = f'[learners.site-b]\ntoken_sha256 = "{credentials.digest(tokens["site-b"])}"\n'
        path.write_text(keep_only_text)  # a good file again: it is read, and site-a is revoked
        wait_for(lambda: heartbeat(s.address, "site-a", session)[0] == grpc.StatusCode.PERMISSION_DENIED, timeout=30)
    finally:
        s.stop()


def test_a_restart_on_the_edited_file_closes_the_restored_sessions_it_no_longer_vouches_for(tmp_path, creds):
    # finding: after a restart the removed learner's session, restored from the state folder, still heartbeated
    path, tokens = creds
    opts = ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / "state", credentials=path)
    s = SyncerThread(CFG, opts)
    try:
        Learner(Net(), GrpcTransport(s.address, token=tokens["site-c"]), "site-c").close()
        sessions = {lid: join(s.address, lid, tokens[lid])[1] for lid in ("site-a", "site-b")}
    finally:
        s.stop()  # the ledger, with both sessions (as hashes), is saved
    keep_only(path, "site-b", "site-c")
    s = SyncerThread(CFG, opts)
    try:
        code, details = heartbeat(s.address, "site-a", sessions["site-a"])
        assert code == grpc.StatusCode.PERMISSION_DENIED and "was revoked" in details
        assert heartbeat(s.address, "site-b", sessions["site-b"])[0] == grpc.StatusCode.OK
    finally:
        s.stop()
    credentials.add(path, "site-b")  # a new token for site-b: the session opened with the old one is closed
    s = SyncerThread(CFG, opts)
    try:
        code, details = heartbeat(s.address, "site-b", sessions["site-b"])
        assert code == grpc.StatusCode.PERMISSION_DENIED and "was revoked" in details
    finally:
        s.stop()


def test_sighup_reads_the_file_even_when_a_look_at_it_sees_no_change(tmp_path, creds):
    path, tokens = creds
    state = tmp_path / "state"
    log = (tmp_path / "syncer.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "--listen", "127.0.0.1:0", "--http",
                             "127.0.0.1:0", "--state", str(state), "--credentials", str(path), "--learners", "2",
                             "--fragments", "2", "--sync-every", "4"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "syncer.log").read_text()
            try:
                return json.loads((state / "ready.json").read_text())["pid"] == proc.pid
            except (OSError, ValueError, KeyError):
                return False

        wait_for(ready, timeout=120)
        address = f"127.0.0.1:{json.loads((state / 'ready.json').read_text())['grpc_port']}"
        Learner(Net(), GrpcTransport(address, token=tokens["site-b"]), "site-b").close()
        _, session = join(address, "site-a", tokens["site-a"])
        assert heartbeat(address, "site-a", session)[0] == grpc.StatusCode.OK
        # site-a's token replaced in place: same inode, same size, its modification time put back
        before = os.stat(path)
        text = path.read_text().replace(credentials.digest(tokens["site-a"]), credentials.digest("another token"))
        with open(path, "r+") as f:
            f.write(text)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
        os.kill(proc.pid, signal.SIGHUP)
        wait_for(lambda: heartbeat(address, "site-a", session)[0] == grpc.StatusCode.PERMISSION_DENIED, timeout=30)
        assert proc.poll() is None  # SIGHUP reloads; it does not stop the syncer
        assert "credentials reloaded from" in (tmp_path / "syncer.log").read_text()
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def test_a_revoked_learners_contribution_in_an_open_round_is_not_merged():
    from diloco.syncer.revocation import revoke

    core, _ = make_core(learners=3)
    a, b = core.join("a", SPECS), core.join("b", SPECS)
    assert push(core, "a", a, 1).accepted and push(core, "b", b, 1).accepted  # both pending in fragment 1's round
    version = core.fragments[1].version
    assert revoke(core, lambda record: record.id != "a") == ["a"]
    core.poll(force=True)
    assert core.fragments[1].version == version and core.dropped_rounds == 1  # dropped, not published
    with pytest.raises(Refused, match="was revoked"):
        core.heartbeat("a", a)
    with pytest.raises(Refused, match="was revoked"):
        push(core, "a", a, 2)
    assert core.live() == {"b"}
    assert revoke(core, lambda record: record.id != "a") == []  # once
    again = core.join("a", SPECS)  # re-admitted by a new credential: a new session, not revoked
    assert not core.heartbeat("a", again) and not core.learners["a"].revoked
