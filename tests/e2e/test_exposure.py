"""What the syncer exposes beyond loopback: tokens never in plaintext without --insecure, /status and /metrics behind
a token, strict JSON without session ids, TLS mismatches reported as TLS problems. Only loopback is ever bound or
contacted: the decisions about other addresses are tested as functions."""

import datetime
import ipaddress
import json
import socket
import time
import urllib.request

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from diloco.cli import main
from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving import http as syncer_http
from diloco.syncer.serving.http import http_authorized, status_json
from diloco.syncer.serving.server import ServerOptions, SyncerThread, exposure_problems
from diloco.wire.tls import is_loopback, plaintext_token_problem, tls_problem
from certificates import issue, write
from fakes import TinyNet


def run_cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


# ---- plaintext tokens beyond loopback ----------------------------------------------------------------------------
def test_loopback_addresses():
    assert all(is_loopback(a) for a in ("127.0.0.1:1", "127.3.2.1:1", "localhost:5", "[::1]:5", "[::ffff:127.0.0.1]:5"))
    assert not any(is_loopback(a) for a in ("0.0.0.0:1", ":50051", "[::]:1", "10.0.0.1:1", "example.com:1"))


def test_syncer_refuses_a_plaintext_token_beyond_loopback_unless_insecure(tmp_path):
    errors, warnings = exposure_problems(ServerOptions(listen="0.0.0.0:50051", http=None, token="t"))
    assert len(errors) == 1 and "plaintext" in errors[0] and "--insecure" in errors[0] and "--tls-cert" in errors[0]
    errors, warnings = exposure_problems(ServerOptions(listen="0.0.0.0:50051", http=None, token="t", insecure=True))
    assert not errors and len(warnings) == 1 and "plaintext" in warnings[0]
    cert = tmp_path / "c.pem"
    assert exposure_problems(ServerOptions(listen="0.0.0.0:50051", http=None, token="t", tls_cert=cert,
                                           tls_key=cert)) == ([], [])
    assert exposure_problems(ServerOptions(listen="127.0.0.1:50051", http="127.0.0.1:0", token="t")) == ([], [])
    errors, _ = exposure_problems(ServerOptions(listen="0.0.0.0:50051", http=None))
    assert errors == ["listening on 0.0.0.0:50051 (beyond loopback) needs secrets: pass --credentials (a token per "
                      "learner) or --token (one shared by trusted learners)"]


def test_http_beyond_loopback_needs_a_status_token():
    errors, _ = exposure_problems(ServerOptions(listen="127.0.0.1:1", http="0.0.0.0:8080"))
    assert "--status-token" in errors[0]
    errors, _ = exposure_problems(ServerOptions(listen="127.0.0.1:1", http="0.0.0.0:8080", token="t"))
    assert "plaintext HTTP" in errors[0] and "--status-token" in errors[0]
    assert exposure_problems(ServerOptions(listen="127.0.0.1:1", http="0.0.0.0:8080", token="t",
                                           status_token="r")) == ([], [])


def test_cli_syncer_refuses_plaintext_token_beyond_loopback(capsys):
    # refused before anything is bound
    code, err = run_cli(capsys, "syncer", "--listen", "0.0.0.0:0", "--token", "t", "--http", "127.0.0.1:0")
    assert code == 2 and "plaintext" in err and "--insecure" in err and "Traceback" not in err


def test_learner_refuses_plaintext_token_beyond_loopback(capsys):
    assert plaintext_token_problem("127.0.0.1:5", "t", tls=False) is None
    assert plaintext_token_problem("10.1.2.3:5", "", tls=False) is None
    assert plaintext_token_problem("10.1.2.3:5", "t", tls=True) is None
    assert "--insecure" in plaintext_token_problem("10.1.2.3:5", "t", tls=False)
    # refused before any connection is made (nothing is contacted)
    code, err = run_cli(capsys, "learner", "--syncer", "10.1.2.3:5", "--id", "x", "--token", "t")
    assert code == 2 and "plaintext" in err and "--tls-ca" in err and "--insecure" in err


# ---- /status and /metrics ------------------------------------------------------------------------------------
def test_http_access_decision():
    tokens = ["run-secret", "read-only", ""]
    assert http_authorized("127.0.0.1", None, tokens)
    assert http_authorized("::1", None, tokens)
    assert not http_authorized("10.0.0.7", None, tokens)
    assert not http_authorized("10.0.0.7", "Bearer wrong", tokens)
    assert not http_authorized("10.0.0.7", "Bearer ", tokens)  # an empty token never matches an unset one
    assert not http_authorized("10.0.0.7", "Basic run-secret", tokens)
    assert http_authorized("10.0.0.7", "Bearer run-secret", tokens)
    assert http_authorized("10.0.0.7", "bearer read-only", tokens)
    assert not http_authorized("10.0.0.7", "Bearer x", ["", ""])


def test_status_is_strict_json_without_session_ids():
    status = {"rounds": 1, "averages": {"step": float("nan"), "sync": float("inf")}, "session": "abc",
              "learners": [{"id": "a", "loss": float("nan"), "session": "0123456789abcdef", "sessions": ["x"],
                            "tokens": 5, "speed": -float("inf")}]}
    body = status_json(status).decode()
    parsed = json.loads(body, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert parsed == {"rounds": 1, "averages": {"step": None, "sync": None},
                      "learners": [{"id": "a", "loss": None, "tokens": 5, "speed": None}]}
    assert "session" not in body and "0123456789abcdef" not in body


def test_live_status_has_no_session_and_slow_http_clients_are_dropped(monkeypatch):
    monkeypatch.setattr(syncer_http, "HTTP_TIMEOUT", 0.5)
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0", token="s3cret"))
    try:
        learner = Learner(TinyNet(), GrpcTransport(syncer.address, token="s3cret"), "a")
        session = learner.transport.session
        port = syncer.status["http_port"]
        deadline = time.monotonic() + 60  # a loaded machine can be far slower than usual
        while True:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5).read().decode()
            if '"id": "a"' in body or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert '"id": "a"' in body and session not in body and "session" not in body
        json.loads(body, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:  # sends nothing
            slow.sendall(b"GET /sta")
            started = time.monotonic()
            while slow.recv(100):  # the server may answer (an error) before it closes; recv times out otherwise
                pass
            assert time.monotonic() - started < 4
        learner.close()
    finally:
        syncer.stop()


# ---- TLS mismatches --------------------------------------------------------------------------------------------
def test_tls_failures_are_recognised():
    assert "not trusted" in tls_problem("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
                                        "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
                                        "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", "127.0.0.1:1")
    assert "does not name the host" in tls_problem("Custom verification check failed with error: UNAUTHENTICATED: "
                                                   "Hostname Verification Check failed.", "h:1")
    assert "does not speak TLS" in tls_problem("SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER", "h:1")
    assert tls_problem("failed to connect to all addresses; Connection refused", "h:1") is None


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = issue("diloco test CA", ca=True)
    ca, _ = write(folder, "ca", ca_key, ca_cert)
    other_key, other_cert = issue("another CA", ca=True)
    other, _ = write(folder, "other", other_key, other_cert)
    server_files = write(folder, "server", *issue("syncer", ca_key, ca_cert.subject))
    # a certificate for another host name only
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elsewhere")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("elsewhere.example"),
                                                        x509.IPAddress(ipaddress.ip_address("192.0.2.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    elsewhere = write(folder, "elsewhere", key, cert)
    return {"ca": ca, "other": other, "server": server_files, "elsewhere": elsewhere}


def tls_syncer(cert_key=None):
    cert, key = cert_key if cert_key else (None, None)
    return SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                        ServerOptions(listen="127.0.0.1:0", http=None, tls_cert=cert, tls_key=key))


@pytest.mark.parametrize("case, expected", [
    ("wrong ca", "not trusted"),
    ("host name", "does not name the host"),
    ("plaintext syncer", "does not speak TLS"),
])
def test_tls_mismatch_is_reported_as_a_tls_problem_at_once(pki, case, expected):
    syncer = tls_syncer({"wrong ca": pki["server"], "host name": pki["elsewhere"], "plaintext syncer": None}[case])
    try:
        ca = pki["other"] if case == "wrong ca" else pki["ca"]
        started = time.monotonic()
        with pytest.raises(SyncerError, match="TLS handshake with the syncer") as e:
            Learner(TinyNet(), GrpcTransport(syncer.address, tls_ca=ca, connect_timeout=20), "a")
        assert expected in str(e.value) and "cannot reach" not in str(e.value)
        assert time.monotonic() - started < 10  # not retried for connect_timeout: retrying cannot fix it
    finally:
        syncer.stop()


def test_plaintext_learner_against_tls_syncer_says_tls(pki):
    syncer = tls_syncer(pki["server"])
    try:
        with pytest.raises(SyncerError, match="TLS problem: if the syncer uses TLS, pass --tls-ca"):
            Learner(TinyNet(), GrpcTransport(syncer.address, connect_timeout=1.0), "a")
    finally:
        syncer.stop()
