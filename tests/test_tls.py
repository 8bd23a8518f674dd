"""TLS and mutual TLS between learners and the syncer, with certificates made for the test."""

import datetime
import ipaddress

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from fakes import TinyNet


def issue(name, issuer_key=None, issuer_name=None, ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def write(folder, name, key, cert):
    (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return folder / f"{name}.pem", folder / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = issue("diloco test CA", ca=True)
    ca, _ = write(folder, "ca", ca_key, ca_cert)
    server = write(folder, "server", *issue("syncer", ca_key, ca_cert.subject))
    client = write(folder, "client", *issue("learner", ca_key, ca_cert.subject))
    return {"ca": ca, "server": server, "client": client}


def start(pki, mutual=False):
    cert, key = pki["server"]
    return SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                        ServerOptions(listen="127.0.0.1:0", http=None, tls_cert=cert, tls_key=key,
                                      tls_client_ca=pki["ca"] if mutual else None))


def test_tls_learner_trains_against_a_tls_syncer(pki):
    syncer = start(pki)
    try:
        model = TinyNet()
        learner = Learner(model, GrpcTransport(syncer.address, tls_ca=pki["ca"]), "a")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(8):
            opt.zero_grad()
            model.lin(model.emb(torch.arange(8))).pow(2).mean().backward()
            opt.step()
            learner.step(8)
        learner.finish()
    finally:
        status = syncer.stop()
    assert status["rounds"] >= 2


def test_plaintext_learner_is_told_about_tls(pki):
    syncer = start(pki)
    try:
        with pytest.raises(SyncerError, match="if the syncer uses TLS, pass --tls-ca"):
            Learner(TinyNet(), GrpcTransport(syncer.address, connect_timeout=1.0), "a")
    finally:
        syncer.stop()


def test_mutual_tls_requires_a_client_certificate(pki):
    syncer = start(pki, mutual=True)
    try:
        with pytest.raises(SyncerError, match="cannot reach"):
            Learner(TinyNet(), GrpcTransport(syncer.address, tls_ca=pki["ca"], connect_timeout=1.0), "a")
        cert, key = pki["client"]
        learner = Learner(TinyNet(), GrpcTransport(syncer.address, tls_ca=pki["ca"], tls_cert=cert, tls_key=key), "b")
        learner.close()
    finally:
        syncer.stop()


def test_tls_flags_are_checked():
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        GrpcTransport("127.0.0.1:1", tls_cert="x.pem")
    with pytest.raises(ValueError, match="cannot read --tls-ca /nonexistent.pem"):
        GrpcTransport("127.0.0.1:1", tls_ca="/nonexistent.pem")


def test_a_client_certificate_proves_one_learner_id(pki, tmp_path):
    cert, key = pki["server"]
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None, tls_cert=cert, tls_key=key,
                                        tls_client_ca=pki["ca"], client_cert_ids=True))
    try:
        client_cert, client_key = pki["client"]  # its common name is "learner"
        with pytest.raises(SyncerError, match="is not the one its client certificate names"):
            Learner(TinyNet(), GrpcTransport(syncer.address, tls_ca=pki["ca"], tls_cert=client_cert, tls_key=client_key,
                                         connect_timeout=5), "someone-else")
        first = Learner(TinyNet(), GrpcTransport(syncer.address, tls_ca=pki["ca"], tls_cert=client_cert,
                                             tls_key=client_key), "learner")
        # the certificate is the credential: a restart reclaims the id while the first session still looks live
        again = Learner(TinyNet(), GrpcTransport(syncer.address, tls_ca=pki["ca"], tls_cert=client_cert,
                                             tls_key=client_key, connect_timeout=10), "learner")
        again.close()
        first.close()
    finally:
        syncer.stop()


def test_client_cert_ids_need_mutual_tls():
    from diloco.syncer.serving.server import exposure_problems

    errors, _ = exposure_problems(ServerOptions(client_cert_ids=True))
    assert any("--client-cert-ids needs mutual TLS" in e for e in errors)
