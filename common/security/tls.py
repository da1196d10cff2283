"""TLS credentials from PEM files, re-read when the files change.

Server side: `grpc.dynamic_ssl_server_credentials` asks `ServerTLS.fetch` for the
certificate configuration at every new TLS handshake; the fetcher compares the
files' (mtime, size) and re-reads them only when one changed, so a rotated
certificate is served to new connections without a restart while open
connections keep theirs.

Client side (the engine dialling routers): grpc-python has no dynamic channel
credentials, so `ClientTLS.credentials()` reads the files afresh each time it is
called, and the engine opens a new channel for every Session attempt. A rotated
client certificate or CA is therefore used from the next reconnect on; open
Sessions keep the certificate they were established with.

Files are replaced by rename (as Kubernetes Secret volumes and cert-manager do),
so a reader sees either the old or the new file. A read that fails (a file half
rotated by a non-atomic writer, or a key that does not match the certificate)
keeps the last good configuration and is logged.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio

log = logging.getLogger(__name__)


class TLSConfigError(ValueError):
    """A certificate, key or CA file is missing or unusable (names the file)."""


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TLSConfigError(f"{what} {path}: {err.strerror or err}") from None
    if b"-----BEGIN" not in data:
        raise TLSConfigError(f"{what} {path}: not a PEM file")
    return data


def _check_pair(cert_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path) -> None:
    """Fails when the key is not the certificate's key (a half-rotated pair)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
    except ValueError as err:
        raise TLSConfigError(f"{cert_path} / {key_path}: {err}") from None
    pem = serialization.Encoding.PEM
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(pem, spki) != key.public_key().public_bytes(pem, spki):
        raise TLSConfigError(f"{key_path} is not the private key of {cert_path}")


def _stamp(paths: list[Path]) -> tuple:
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


@dataclass
class PemFiles:
    """A certificate chain, its private key and a CA bundle, as paths."""

    cert: Path
    key: Path
    ca: Path

    def __post_init__(self) -> None:
        self.cert, self.key, self.ca = Path(self.cert), Path(self.key), Path(self.ca)

    @property
    def paths(self) -> list[Path]:
        return [self.cert, self.key, self.ca]

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(cert chain, key, CA) PEM bytes; raises TLSConfigError naming the bad file."""
        cert = _read(self.cert, "--tls-cert")
        key = _read(self.key, "--tls-key")
        ca = _read(self.ca, "--tls-ca")
        _check_pair(cert, key, self.cert, self.key)
        return cert, key, ca


@dataclass
class ServerTLS:
    """A TLS server's files; `require_client_cert` makes it mutual TLS (the
    client's certificate must chain to the CA file)."""

    files: PemFiles
    require_client_cert: bool
    _stamp: tuple = field(default=(), init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    reloads: int = field(default=0, init=False)

    def _configuration(self):
        cert, key, ca = self.files.read()
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=ca if self.require_client_cert else None
        )

    def credentials(self) -> grpc.ServerCredentials:
        """Reads the files once now (so bad files fail start-up) and re-reads them on change."""
        with self._lock:
            self._stamp = _stamp(self.files.paths)
            initial = self._configuration()
        return grpc.dynamic_ssl_server_credentials(
            initial, self.fetch, require_client_authentication=self.require_client_cert
        )

    def fetch(self):
        """Called by gRPC at every handshake: a new configuration when the files changed, else None."""
        with self._lock:
            stamp = _stamp(self.files.paths)
            if stamp == self._stamp:
                return None
            try:
                configuration = self._configuration()
            except TLSConfigError as err:
                log.error("TLS files changed but cannot be used (%s); keeping the previous certificate", err)
                return None
            self._stamp = stamp
            self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.files.cert)
        return configuration


    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate for an HTTP server (the engine's OpenAI port),
        read afresh at the first handshake after the files changed."""
        current = {"stamp": _stamp(self.files.paths), "context": self._ssl_context()}

        def refresh(connection, server_name, outer) -> None:
            stamp = _stamp(self.files.paths)
            if stamp != current["stamp"]:
                current["stamp"] = stamp
                try:
                    current["context"] = self._ssl_context()
                    log.info("TLS certificate reloaded from %s (HTTP)", self.files.cert)
                except TLSConfigError as err:
                    log.error("TLS files changed but cannot be used (%s); keeping the previous certificate", err)
            if current["context"] is not outer:
                connection.context = current["context"]

        current["context"].sni_callback = refresh
        return current["context"]

    def _ssl_context(self) -> ssl.SSLContext:
        self.files.read()  # a half-rotated pair fails here, naming the file
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.files.cert, self.files.key)
        if self.require_client_cert:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.files.ca)
        return context


@dataclass
class ClientTLS:
    """The engine's side of mutual TLS toward routers: its client certificate and
    the CA that every router's certificate must chain to."""

    files: PemFiles

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the files now: call once per new channel so rotation is picked up."""
        cert, key, ca = self.files.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def dial_options(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options that make gRPC verify the peer's certificate against
    `server_name` rather than the dialled address: used when the engine dials
    the addresses a DNS name resolved to (each replica's certificate must carry
    the DNS name, not its pod IP)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def secure_channel(address: str, credentials: grpc.ChannelCredentials, options: list,
                   server_name: str | None = None) -> aio.Channel:
    return aio.secure_channel(address, credentials, options=[*options, *dial_options(server_name)])


@dataclass
class ChannelFactory:
    """Opens the engine's channels to routers: plaintext (tls None) or mutual
    TLS with credentials read afresh for every channel. `server_name` is the DNS
    name the addresses were resolved from; each router's certificate must carry
    it. Without it, gRPC checks the certificate against the dialled host."""

    tls: ClientTLS | None = None
    server_name: str | None = None

    def __call__(self, address: str, options: list) -> aio.Channel:
        if self.tls is None:
            return aio.insecure_channel(address, options=options)
        return secure_channel(address, self.tls.credentials(), options, self.server_name)
