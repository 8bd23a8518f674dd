"""TLS credentials from PEM files, for the syncer and for learners."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc

from diloco import untrusted_files

MAX_PEM = 1 << 20
"""Largest PEM file read (a certificate chain is a few KB)."""


def is_loopback(address: str) -> bool:
    """Is HOST:PORT's host a loopback address (127.0.0.0/8, ::1, localhost)? An empty host means every interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if getattr(ip, "ipv4_mapped", None) is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def plaintext_token_problem(address: str, token: str | None, tls: bool) -> str | None:
    """Why a learner should not send `token` to the syncer at `address` in plaintext, or None. Beyond loopback a
    token without TLS is refused unless the user passed --insecure (the caller decides, and then warns)."""
    if not token or tls or is_loopback(address):
        return None
    return (f"the syncer at {address} is beyond loopback and this learner has no TLS: the run token and the model "
            f"would travel in plaintext; pass --tls-ca (or --tls) for a syncer with --tls-cert, or --insecure to "
            f"accept that")


def _read(path: Path | str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:  # a link is followed (a mounted secret), but only to a regular file
        return untrusted_files.read_bytes(path, MAX_PEM, follow_symlinks=True)
    except untrusted_files.UntrustedFileError as e:
        raise ValueError(f"cannot read {flag} {path}: {e.why}") from None
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


TLS_FAILURES = (  # (words in gRPC's UNAVAILABLE details, what the learner is told); first match wins
    (("hostname verification", "peer name", "not in peer certificate"),
     "the syncer's certificate does not name the host {host!r} this learner connects to: connect by a name or address "
     "listed in the certificate (its subject alternative names), or reissue the syncer's --tls-cert for this host"),
    (("certificate_verify_failed", "certificate verify failed", "unable to get local issuer", "self signed",
      "self-signed", "certificate has expired", "certificate is not yet valid"),
     "the syncer's certificate is not trusted: check that --tls-ca is the CA that signed the syncer's --tls-cert "
     "(and that the certificate has not expired)"),
    (("wrong_version_number", "http_request", "packet length too long"),
     "the syncer does not speak TLS (was it started without --tls-cert?): drop --tls / --tls-ca, or start the "
     "syncer with --tls-cert and --tls-key"),
    (("handshake", "ssl_error", "tsi_", "ssl routines"),
     "check --tls-ca against the CA of the syncer's certificate, the certificate's host name, and whether the "
     "syncer uses TLS (and requires a client certificate: --tls-cert and --tls-key)"),
)


def tls_problem(details: str, address: str) -> str | None:
    """What to do about a TLS handshake failure that gRPC reports as UNAVAILABLE `details`; None when it is not one."""
    text = (details or "").lower()
    for words, advice in TLS_FAILURES:
        if any(w in text for w in words):
            host = address.rsplit(":", 1)[0].strip("[]")
            return (f"TLS handshake with the syncer at {address} failed — a TLS/certificate problem, not the network: "
                    f"{advice.format(host=host)} ({details})")
    return None
