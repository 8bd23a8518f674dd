"""TLS credentials from PEM files, for the syncer and for learners."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: Path | str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {flag} {path}: {e.strerror}") from None


def server_credentials(cert: Path | None, key: Path | None, client_ca: Path | None = None) -> grpc.ServerCredentials | None:
    """None for plaintext; with `client_ca`, learners must present a certificate signed by it."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key too")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    ca = _read(client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials([(_read(key, "--tls-key"), _read(cert, "--tls-cert"))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(ca: Path | None, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    """Trust `ca` (or the system's roots when None); present a client certificate when given."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "--tls-ca"), private_key=_read(key, "--tls-key"),
                                        certificate_chain=_read(cert, "--tls-cert"))
