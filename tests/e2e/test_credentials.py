"""Per-learner credentials and per-learner limits at the gRPC boundary: an id is its holder's alone, a restarted
learner reclaims it at once, and one party cannot multiply what it costs the syncer."""

import asyncio
import os
import stat
import subprocess
import sys
import threading
import time

import grpc
import pytest

from diloco.config import for_mode
from diloco.algorithm.fragments import tensor_specs
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.defences import credentials
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.syncer.serving.update_streams import MAX_STREAMS
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from liveness import wait_for
from fakes import TinyNet as Net
from rpc import join

SHARED = "shared-s3cret"


@pytest.fixture
def creds(tmp_path):
    path = tmp_path / "learners.toml"
    tokens = {lid: credentials.add(path, lid) for lid in ("site-a", "site-b")}
    return path, tokens


@pytest.fixture
def syncer(creds):
    path, _ = creds
    s = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                     ServerOptions(listen="127.0.0.1:0", http=None, credentials=path))
    yield s
    s.stop()


def test_the_file_keeps_only_digests_and_is_readable_by_its_owner_alone(creds):
    path, tokens = creds
    text = path.read_text()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert all(t not in text for t in tokens.values())
    assert credentials.Credentials.load(path).check("site-a", tokens["site-a"])
    assert not credentials.Credentials.load(path).check("site-a", tokens["site-b"])


@pytest.mark.parametrize("content, message", [
    ("[learners.a]\ntoken = 'x'\n", "needs token_sha256"),
    ("[learners.a]\ntoken_sha256 = 'abc'\n", "needs token_sha256"),
    ("[people.a]\n", "unknown key"),
    ("not toml [", "not valid TOML"),
    ("", "no \\[learners.<id>\\] entry"),
    ('[learners."-bad"]\ntoken_sha256 = "' + "0" * 64 + '"\n', "not a valid learner id"),
])
def test_a_malformed_file_is_refused_naming_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "c.toml"
    path.write_text(content)
    with pytest.raises(credentials.CredentialsError, match=message):
        credentials.Credentials.load(path)


def test_a_listed_id_joins_with_its_own_token_only(syncer, creds):
    _, tokens = creds
    Learner(Net(), GrpcTransport(syncer.address, token=tokens["site-a"]), "site-a").close()  # uploads the model
    # finding: any token holder could take an id before its owner started; neither the shared token nor another
    # learner's own token opens it now
    for token in (SHARED, tokens["site-a"], "guess"):
        code, details = join(syncer.address, "site-b", token)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "its own token" in details
    assert join(syncer.address, "site-b", tokens["site-b"])[0] == grpc.StatusCode.OK
    # an unlisted id joins with no token at all: a shared token never stands beside the file
    for token in (SHARED, tokens["site-a"], ""):
        code, details = join(syncer.address, "guest", token)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "has no credential" in details


def test_a_restarted_learner_reclaims_its_live_id_with_its_credential(syncer, creds):
    # finding: 0.0 s after a learner crashed, another token holder took its id, and the owner was refused it
    _, tokens = creds
    first = Learner(Net(), GrpcTransport(syncer.address, token=tokens["site-a"]), "site-a")
    try:
        assert join(syncer.address, "site-a", SHARED)[0] == grpc.StatusCode.UNAUTHENTICATED  # live, not theirs
        again = Learner(Net(), GrpcTransport(syncer.address, token=tokens["site-a"], connect_timeout=10), "site-a")
        again.close()  # joined at once although the first session still looked live
    finally:
        first.close()


def test_without_a_shared_token_an_unlisted_id_is_told_to_ask_for_a_credential(creds):
    path, tokens = creds
    s = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                     ServerOptions(listen="127.0.0.1:0", http=None, credentials=path))
    try:
        Learner(Net(), GrpcTransport(s.address, token=tokens["site-a"]), "site-a").close()
        code, details = join(s.address, "stranger", "")
        assert code == grpc.StatusCode.UNAUTHENTICATED and "diloco credentials new" in details
        with pytest.raises(SyncerError, match="credential"):
            Learner(Net(), GrpcTransport(s.address, token="nope", connect_timeout=5), "site-b")
    finally:
        s.stop()


def test_heartbeats_beyond_the_rate_are_refused_and_later_ones_answered(syncer, creds):
    syncer.service.heartbeats.per_credential = 2.0  # exceeded however slowly this machine answers
    _, tokens = creds
    Learner(Net(), GrpcTransport(syncer.address, token=tokens["site-b"]), "site-b").close()  # uploads the model
    code, session = join(syncer.address, "site-a", tokens["site-a"])
    stub = pb_grpc.SyncerStub(grpc.insecure_channel(syncer.address))
    codes = []
    for _ in range(20):
        try:
            stub.Heartbeat(pb.HeartbeatRequest(learner_id="site-a", session=session), timeout=10)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
            assert "faster than" in e.details()
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the allowance refills
        try:
            stub.Heartbeat(pb.HeartbeatRequest(learner_id="site-a", session=session), timeout=10)
            return
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(0.1)
    pytest.fail("heartbeats were not answered again once the allowance refilled")


def test_update_streams_per_learner_are_bounded(syncer, creds):
    _, tokens = creds
    Learner(Net(), GrpcTransport(syncer.address, token=tokens["site-a"]), "site-a").close()
    code, session = join(syncer.address, "site-b", tokens["site-b"])
    channel = grpc.insecure_channel(syncer.address)
    stub = pb_grpc.SyncerStub(channel)
    streams = [stub.Subscribe(pb.SubscribeRequest(learner_id="site-b", session=session)) for _ in range(MAX_STREAMS)]
    try:
        wait_for(lambda: syncer.service.update_streams("site-b") == MAX_STREAMS, 120)
        extra = stub.Subscribe(pb.SubscribeRequest(learner_id="site-b", session=session), timeout=120)
        with pytest.raises(grpc.RpcError) as refused:
            next(extra)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "update streams open" in refused.value.details()
    finally:
        for s in streams:
            s.cancel()
        channel.close()


def test_the_command_prints_a_token_and_a_syncer_process_admits_it(tmp_path):
    path = tmp_path / "c.toml"
    out = subprocess.run([sys.executable, "-m", "diloco", "credentials", "new", "site-z", "--file", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert credentials.Credentials.load(path).check("site-z", token) and token not in path.read_text()
    bad = subprocess.run([sys.executable, "-m", "diloco", "credentials", "new", "-x", "--file", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_two_ids_with_the_same_digest_are_refused_naming_both(tmp_path):
    # finding: a file giving two ids the same digest loaded silently: one token proved both
    path = tmp_path / "c.toml"
    value = credentials.digest("one token")
    path.write_text(f'[learners.site-a]\ntoken_sha256 = "{value}"\n[learners.site-b]\ntoken_sha256 = "{value}"\n')
    with pytest.raises(credentials.CredentialsError,
                       match=r"\[learners.site-a\] and \[learners.site-b\] have the same token_sha256"):
        credentials.Credentials.load(path)


def on_core(syncer, fn, *args):
    """Call `fn` on the syncer's core worker, as its RPCs do, and return what it returns."""
    return asyncio.run_coroutine_threadsafe(syncer.service._core(fn, *args), syncer._loop).result(60)


def test_many_ids_of_one_credential_share_its_heartbeats_and_another_credential_keeps_its_own(creds):
    # finding: limits were per id, so 20 ids of one party sent 1,320 heartbeats a second and slowed an honest learner
    path, tokens = creds
    credentials.add(path, "mallory")
    s = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                     ServerOptions(listen="127.0.0.1:0", http=None, credentials=path))
    try:
        Learner(Net(), GrpcTransport(s.address, token=tokens["site-b"]), "site-b").close()  # uploads the model
        s.service.heartbeats.per_credential = 10.0  # each credential's burst; the honest learner stays within its own
        ids = [f"m{i}" for i in range(20)]  # one party's ids, as the core counts them (test_hostile_learners.py)
        sessions = {lid: on_core(s, s.service.core.join, lid, tensor_specs(Net()), "mallory") for lid in ids}
        _, honest = join(s.address, "site-a", tokens["site-a"])
        stub = pb_grpc.SyncerStub(grpc.insecure_channel(s.address))
        answered, honest_codes = [], []

        def beat(learner_id, session):
            try:
                stub.Heartbeat(pb.HeartbeatRequest(learner_id=learner_id, session=session), timeout=30)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

        def flood(part):
            for n, lid in enumerate(ids * 10):
                if lid in part:
                    answered.append(beat(lid, sessions[lid]) == grpc.StatusCode.OK)
                if part is first and n % 20 == 0:  # the honest learner's heartbeats, amid the flood
                    honest_codes.append(beat("site-a", honest))

        first, second = set(ids[::2]), set(ids[1::2])
        started = time.monotonic()
        threads = [threading.Thread(target=flood, args=(part,)) for part in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        elapsed = time.monotonic() - started
        assert len(answered) == 200 and len(honest_codes) == 10
        assert honest_codes == [grpc.StatusCode.OK] * 10  # never starved by the flood
        assert sum(answered) <= 10 + 10 * elapsed + 1  # one budget for all 20 ids (200 answered before)
    finally:
        s.stop()


def test_beyond_the_total_each_active_credential_gets_an_equal_share_and_an_honest_one_all_it_needs():
    from diloco.syncer.defences.heartbeat_budget import HeartbeatBudget

    now = [0.0]
    budget = HeartbeatBudget(per_credential=100.0, total=200.0, floor=5.0, clock=lambda: now[0])
    flooded = honest = 0
    for tick in range(200):  # 2 s in steps of 10 ms: 40 parties try 100 a second each, an honest one 2
        now[0] = tick / 100
        flooded += sum(budget.allow(f"party-{i}") for i in range(40))
        if tick % 50 == 0:
            honest += budget.allow("honest")
    assert honest == 4 and budget.rate() == 5.0  # 200 / 41 < 5: the floor
    assert flooded <= 40 * 5 * 2 + 40 * 5 + 40  # each party its share (and one burst), not 100 a second
