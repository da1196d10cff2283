"""How a client reaches a service: target, TLS and a bearer token.

One `Connection` makes both kinds of channel (blocking and asyncio) with the
same message-size limits and keepalive as the services (common.grpc_server),
and the metadata every call carries. `from_env` builds one from the variables
that tools and the lifecycle commands read (common.security.client).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

from common.grpc_server import MAX_MESSAGE_BYTES, channel_options
from common.security.client import ENV_ADMIN_TOKEN, ENV_CA, ENV_CERT, ENV_KEY, ENV_TOKEN, token_from_env
from common.security.tls import dial_options


class PlaintextToken(ValueError):
    """A bearer token was to be sent over a plaintext connection."""


@dataclass(frozen=True)
class Connection:
    """Where and how to connect.

    target: "host:port" (or any gRPC target such as "dns:///name:port").
    root_certificates: PEM bytes, or a path to a PEM file, of the CA that signed
        the server's certificate; setting it (or `tls=True` for the system roots)
        makes the channel TLS.
    certificate_chain, private_key: PEM bytes or paths of a client certificate,
        for servers that require mutual TLS.
    token: sent as `authorization: Bearer <token>` metadata on every call.
        Over plaintext anyone on the path reads it, so a token needs a TLS
        connection unless `allow_token_over_plaintext` says otherwise (a
        development service on loopback).
    max_message_bytes: the largest message sent or received.
    server_name: over TLS, the name the server's certificate must carry when it
        is not the dialled host (an address a DNS name resolved to).
    """

    target: str
    root_certificates: bytes | str | Path | None = None
    tls: bool = False
    certificate_chain: bytes | str | Path | None = None
    private_key: bytes | str | Path | None = None
    token: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    allow_token_over_plaintext: bool = False
    server_name: str | None = None

    def __post_init__(self) -> None:
        if self.token and not self.secure and not self.allow_token_over_plaintext:
            raise PlaintextToken(
                "token: refusing to send a bearer token over a plaintext connection; connect with TLS "
                "(root_certificates, or tls=True for the system's roots), or set "
                "allow_token_over_plaintext=True for a development service")

    @property
    def secure(self) -> bool:
        return self.tls or self.root_certificates is not None or self.certificate_chain is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.root_certificates),
            private_key=_pem(self.private_key),
            certificate_chain=_pem(self.certificate_chain),
        )

    def channel(self) -> grpc.Channel:
        if self.secure:
            return grpc.secure_channel(self.target, self.credentials(), options=self._options())
        return grpc.insecure_channel(self.target, options=self._options())

    def aio_channel(self) -> aio.Channel:
        if self.secure:
            return aio.secure_channel(self.target, self.credentials(), options=self._options())
        return aio.insecure_channel(self.target, options=self._options())

    def _options(self) -> list[tuple[str, object]]:
        options = channel_options(self.max_message_bytes)
        return [*options, *dial_options(self.server_name)] if self.secure else options


def connection(target: str | Connection, **options) -> Connection:
    """A Connection from a target string and options, or the one given."""
    if isinstance(target, Connection):
        if options:
            raise TypeError("pass options either in the Connection or as keywords, not both")
        return target
    return Connection(target, **options)


def from_env(target: str, *, admin: bool = False, server_name: str | None = None,
             environ: Mapping[str, str] = os.environ) -> Connection:
    """A Connection configured by the environment (common.security.client names the
    variables): with UNDERCURRENT_TLS_CA, TLS with the client certificate of
    UNDERCURRENT_TLS_CERT/_KEY and the caller's token (the admin token when `admin`,
    for ProbeAdminService); without it, plaintext and no token."""
    if not environ.get(ENV_CA):
        return Connection(target)
    path = (lambda name: Path(environ[name]) if environ.get(name) else None)
    return Connection(target, root_certificates=path(ENV_CA), certificate_chain=path(ENV_CERT),
                      private_key=path(ENV_KEY),
                      token=token_from_env(ENV_ADMIN_TOKEN if admin else ENV_TOKEN, environ),
                      server_name=server_name)


def _pem(value: bytes | str | Path | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()
