"""The security flags both services share, and what they assemble into.

Both services take `--tls-cert`, `--tls-key`, `--tls-ca`, `--insecure` and
`--reflection`; the engine adds `--client-tokens-file`, the router
`--admin-tokens-file`. TLS is the default: without `--insecure`, all three TLS
files are required, and so is a token source for the token-protected service.
`--insecure` serves plaintext, makes tokens optional (checked when given) and
is logged as a warning at start-up.

- Router: serves TLS with its certificate and requires every caller (engines,
  and operators calling ProbeAdmin) to present a client certificate chaining to
  `--tls-ca`; ProbeAdmin additionally needs an admin token.
- Engine: serves TLS to clients (who authenticate with client tokens), and
  dials routers with mutual TLS: it presents its own certificate and accepts a
  router only if the router's certificate chains to `--tls-ca` and names the
  host it dialled (for `dns:NAME:PORT`, NAME).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.security.tls import ClientTLS, PemFiles, ServerTLS, TLSConfigError
from common.security.tokens import (
    ADMIN_TOKENS_ENV,
    CLIENT_TOKENS_ENV,
    TokenConfigError,
    TokenSet,
)

ENGINE_SERVICE = "undercurrent.v1.EngineService"
PROBE_ADMIN_SERVICE = "undercurrent.v1.ProbeAdminService"


class SecurityConfigError(ValueError):
    """Inconsistent or unusable security flags (the message names the flag)."""


@dataclass
class TokenKind:
    """Which tokens protect which service, and where they come from."""

    label: str  # "client" / "admin": the flag is --LABEL-tokens-file
    service: str
    env_var: str

    @property
    def flag(self) -> str:
        return f"--{self.label}-tokens-file"


CLIENT_TOKENS = TokenKind("client", ENGINE_SERVICE, CLIENT_TOKENS_ENV)
ADMIN_TOKENS = TokenKind("admin", PROBE_ADMIN_SERVICE, ADMIN_TOKENS_ENV)


@dataclass
class ServerSecurity:
    """What a server needs: TLS (None: plaintext), tokens per service, reflection."""

    tls: ServerTLS | None = None
    tokens: dict[str, TokenSet] = field(default_factory=dict)
    reflection: bool = False
    # Logged as a warning once the server listens (--insecure).
    warning: str | None = None

    @classmethod
    def plaintext(cls, reflection: bool = True) -> "ServerSecurity":
        """No TLS, no tokens: in-process servers of the tests."""
        return cls(reflection=reflection)


def add_security_flags(parser: argparse.ArgumentParser, token_kind: TokenKind) -> None:
    group = parser.add_argument_group("security (TLS is required unless --insecure)")
    group.add_argument("--tls-cert", type=Path, help="PEM certificate chain this service presents")
    group.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-ca", type=Path,
        help="PEM CA bundle the peers' certificates must chain to "
             "(router: every caller's client certificate; engine: every router's certificate)",
    )
    group.add_argument(
        token_kind.flag, type=Path, dest="tokens_file",
        help=f"file of {token_kind.label} bearer tokens for {token_kind.service.rsplit('.', 1)[1]}, "
             f"NAME:TOKEN per line (default: ${token_kind.env_var})",
    )
    group.add_argument("--insecure", action="store_true",
                       help="plaintext gRPC, tokens optional: development only (logged as a warning)")
    group.add_argument("--reflection", action="store_true", help="serve gRPC server reflection")


def _token_set(args, kind: TokenKind, environ) -> TokenSet | None:
    try:
        if args.tokens_file is not None:
            return TokenSet.from_file(kind.label, args.tokens_file)
        if environ.get(kind.env_var):
            return TokenSet.from_env(kind.label, kind.env_var, environ)
    except TokenConfigError as err:
        raise SecurityConfigError(str(err)) from None
    return None


def _pem_files(args) -> PemFiles | None:
    given = {flag: getattr(args, flag.replace("-", "_")) for flag in ("tls-cert", "tls-key", "tls-ca")}
    if args.insecure:
        named = [f"--{flag}" for flag, value in given.items() if value is not None]
        if named:
            raise SecurityConfigError(f"--insecure: conflicts with {', '.join(named)} (choose one)")
        return None
    missing = [f"--{flag}" for flag, value in given.items() if value is None]
    if missing:
        raise SecurityConfigError(
            f"{', '.join(missing)}: required for TLS (or --insecure for plaintext development)"
        )
    return PemFiles(given["tls-cert"], given["tls-key"], given["tls-ca"])


def security_from_args(args, token_kind: TokenKind, *, require_client_cert: bool,
                       environ=os.environ) -> tuple[ServerSecurity, ClientTLS | None]:
    """The server's security and (for a service that dials others) its client TLS.

    Reads every file now, so a missing or mismatched file fails start-up with
    one line naming it."""
    files = _pem_files(args)
    tokens = _token_set(args, token_kind, environ)
    service = token_kind.service.rsplit(".", 1)[1]
    if files is None:
        warning = "--insecure: serving PLAINTEXT gRPC with no transport security{}; development only".format(
            "" if tokens else f" and no {token_kind.label} tokens ({service} accepts any caller)")
        tokens_by_service = {token_kind.service: tokens} if tokens else {}
        return ServerSecurity(None, tokens_by_service, args.reflection, warning), None
    if tokens is None:
        raise SecurityConfigError(
            f"{token_kind.flag}: {service} needs {token_kind.label} tokens "
            f"({token_kind.flag} or ${token_kind.env_var}; or --insecure for development)"
        )
    tls = ServerTLS(files, require_client_cert=require_client_cert)
    try:
        files.read()
    except TLSConfigError as err:
        raise SecurityConfigError(str(err)) from None
    return ServerSecurity(tls, {token_kind.service: tokens}, args.reflection), ClientTLS(files)
