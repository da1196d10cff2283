"""Development credentials for `make run`, the test stacks and the benchmarks.

`DevSecurity.ensure()` makes (once, under a lock, in `.cache/devcerts`) a
development CA, certificates for `engine`, `router` (both also naming
localhost and 127.0.0.1, as these services listen on loopback) and `client`,
and token files: two client callers (`demo` and `other`, so tests can act as
two callers) and one admin (`operator`). It hands out the matching service
flags (routers accept Sessions from the `engine` identity only) and client
channels, so every process started through `tools.processes` speaks TLS with
tokens unless asked for plaintext.
"""

from __future__ import annotations

import datetime as dt
import fcntl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from common import devcerts
from common.security import client
from common.security.auth import Access
from common.security.config import PROBE_ROUTER_SERVICE, ServerSecurity
from common.security.tls import PemFiles, ServerTLS
from common.grpc_server import channel_options

DEV_DIR = Path(__file__).resolve().parent.parent / ".cache" / "devcerts"
ROLES = {"engine": devcerts.ENGINE, "router": devcerts.ROUTER, "client": devcerts.CLIENT}
NAMES = tuple(ROLES)
ENGINE_IDENTITY = "engine"


@dataclass(frozen=True)
class DevSecurity:
    directory: Path
    client_token: str  # caller "demo"
    other_client_token: str  # caller "other"
    admin_token: str  # caller "operator"

    @classmethod
    def ensure(cls, directory: Path = DEV_DIR) -> "DevSecurity":
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes make them once
            if not _usable(directory):
                devcerts.generate(directory, ROLES, loopback=("engine", "router"))
                _write_tokens(directory)
        tokens = {name: token for name, token in (
            line.split(":", 1) for path in ("client-tokens", "admin-tokens")
            for line in (directory / path).read_text().split())}
        return cls(directory, tokens["demo"], tokens["other"], tokens["operator"])

    def pem(self, name: str) -> tuple[Path, Path]:
        return self.directory / f"{name}.pem", self.directory / f"{name}.key"

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def _tls_flags(self, name: str) -> list[str]:
        cert, key = self.pem(name)
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(self.ca)]

    def router_server_security(self) -> ServerSecurity:
        """What a router's --tls-* and --engine-identities flags give, for a
        router served in-process (no admin tokens)."""
        cert, key = self.pem("router")
        return ServerSecurity(tls=ServerTLS(PemFiles(cert, key, self.ca), require_client_cert=True),
                              access={PROBE_ROUTER_SERVICE: Access(identities=frozenset({ENGINE_IDENTITY}))})

    def router_flags(self) -> list[str]:
        return [*self._tls_flags("router"), "--admin-tokens-file", str(self.directory / "admin-tokens"),
                "--engine-identities", ENGINE_IDENTITY]

    def engine_flags(self) -> list[str]:
        return [*self._tls_flags("engine"), "--client-tokens-file", str(self.directory / "client-tokens")]

    def channel_credentials(self, token: str | None = None) -> grpc.ChannelCredentials:
        """TLS with the `client` certificate (routers require one) and a bearer
        token on every call: `token`, or by default the admin token for
        ProbeAdminService and the `demo` client token for everything else."""
        cert, key = self.pem("client")
        return client.tls_credentials(self.ca, cert, key, token or self.client_token, token or self.admin_token)

    def client_env(self) -> dict[str, str]:
        """The environment of common.security.client for the `demo` caller and the admin."""
        cert, key = self.pem("client")
        return {client.ENV_CA: str(self.ca), client.ENV_CERT: str(cert), client.ENV_KEY: str(key),
                client.ENV_TOKEN: self.client_token, client.ENV_ADMIN_TOKEN: self.admin_token}

    def channel(self, address: str, token: str | None = None, options=()) -> grpc.aio.Channel:
        """options: more channel arguments, after the defaults."""
        return grpc.aio.secure_channel(address, self.channel_credentials(token),
                                       options=[*channel_options(), *options])


def _usable(directory: Path) -> bool:
    files = [directory / f for f in ("ca.pem", "client-tokens", "admin-tokens")]
    files += [directory / f"{n}.{ext}" for n in NAMES for ext in ("pem", "key")]
    if not all(f.exists() for f in files):
        return False
    expires = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes()).not_valid_after_utc
    return expires - dt.datetime.now(dt.timezone.utc) > dt.timedelta(days=1)


def _write_tokens(directory: Path) -> None:
    devcerts.write_tokens(directory / "client-tokens", ["demo", "other"])
    devcerts.write_tokens(directory / "admin-tokens", ["operator"])
