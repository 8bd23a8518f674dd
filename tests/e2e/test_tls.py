"""TLS and mutual TLS between learners and the syncer, with certificates made for the test."""


import pytest
import torch

from diloco.config import for_mode
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from fakes import TinyNet
from certificates import issue, write


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
