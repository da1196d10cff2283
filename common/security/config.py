"""The security flags both services share, and what they assemble into.

Both services take `--tls-cert`, `--tls-key`, `--tls-ca`, `--insecure` and
`--reflection`; the engine adds `--client-tokens-file`, the router
`--admin-tokens-file`, `--engine-identities` and `--admin-identities`. TLS is
the default: without `--insecure`, all three TLS files are required, and so is
a way to authenticate each protected service's callers. `--insecure` serves
plaintext, makes tokens optional (checked when given), listens on loopback
unless `--host` is given, and is logged as a warning at start-up.

- Router: serves TLS with its certificate and requires every caller to
  present a client certificate chaining to `--tls-ca`. A Session is accepted
  only from a certificate naming one of `--engine-identities`; ProbeAdmin
  needs an admin token and/or a certificate naming one of
  `--admin-identities` (each one given is checked).
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

from common.security.auth import Access
from common.security.tls import ClientTLS, PemFiles, ServerTLS, TLSConfigError
from common.security.tokens import (
    ADMIN_TOKENS_ENV,
    CLIENT_TOKENS_ENV,
    TokenConfigError,
    TokenSet,
)

ENGINE_SERVICE = "undercurrent.v1.EngineService"
PROBE_ROUTER_SERVICE = "undercurrent.v1.ProbeRouterService"
PROBE_ADMIN_SERVICE = "undercurrent.v1.ProbeAdminService"
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"


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
    """What a server needs: TLS (None: plaintext), who may call each service, reflection."""

    tls: ServerTLS | None = None
    access: dict[str, Access] = field(default_factory=dict)
    reflection: bool = False
    # Logged as a warning once the server listens (--insecure).
    warning: str | None = None

    @classmethod
    def plaintext(cls, reflection: bool = True) -> "ServerSecurity":
        """No TLS, no checks: in-process servers of the tests."""
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
                       help="plaintext gRPC, tokens optional, listening on loopback unless --host is "
                            "given: development only (logged as a warning)")
    group.add_argument("--reflection", action="store_true", help="serve gRPC server reflection")


def add_router_identity_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("caller identities (client certificates; TLS only)")
    group.add_argument(
        "--engine-identities", type=_names, metavar="NAMES",
        help="comma-separated certificate identities (a DNS name or the common name) allowed to open "
             "Sessions: the engines' certificates. Required with TLS",
    )
    group.add_argument(
        "--admin-identities", type=_names, metavar="NAMES",
        help="comma-separated certificate identities allowed to call ProbeAdmin; with an admin token "
             "source both are required",
    )


def _names(value: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one name")
    return names


def listen_host(args) -> str:
    """--host, else loopback for --insecure (plaintext is for this machine) and
    every interface for TLS."""
    if args.host:
        return args.host
    return LOOPBACK if args.insecure else ALL_INTERFACES


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
        named += [f"--{flag}" for flag in ("engine-identities", "admin-identities")
                  if getattr(args, flag.replace("-", "_"), None) is not None]
        if named:
            raise SecurityConfigError(f"--insecure: conflicts with {', '.join(named)} (choose one)")
        return None
    missing = [f"--{flag}" for flag, value in given.items() if value is None]
    if missing:
        raise SecurityConfigError(
            f"{', '.join(missing)}: required for TLS (or --insecure for plaintext development)"
        )
    return PemFiles(given["tls-cert"], given["tls-key"], given["tls-ca"])


def _server_tls(files: PemFiles, require_client_cert: bool) -> ServerTLS:
    try:
        files.read()
    except TLSConfigError as err:
        raise SecurityConfigError(str(err)) from None
    return ServerTLS(files, require_client_cert=require_client_cert)


def _plaintext(args, token_kind: TokenKind, tokens: TokenSet | None) -> ServerSecurity:
    service = token_kind.service.rsplit(".", 1)[1]
    warning = "--insecure: serving PLAINTEXT gRPC with no transport security{}; development only".format(
        "" if tokens else f" and no {token_kind.label} tokens ({service} accepts any caller)")
    access = {token_kind.service: Access(tokens=tokens)} if tokens else {}
    return ServerSecurity(None, access, args.reflection, warning)


def engine_security(args, environ=os.environ) -> tuple[ServerSecurity, ClientTLS | None]:
    """The engine's server security and its client TLS toward routers.

    Reads every file now, so a missing or mismatched file fails start-up with
    one line naming it."""
    files = _pem_files(args)
    tokens = _token_set(args, CLIENT_TOKENS, environ)
    if files is None:
        return _plaintext(args, CLIENT_TOKENS, tokens), None
    if tokens is None:
        raise SecurityConfigError(
            f"{CLIENT_TOKENS.flag}: EngineService needs client tokens "
            f"({CLIENT_TOKENS.flag} or ${CLIENT_TOKENS.env_var}; or --insecure for development)"
        )
    tls = _server_tls(files, require_client_cert=False)
    return ServerSecurity(tls, {ENGINE_SERVICE: Access(tokens=tokens)}, args.reflection), ClientTLS(files)


def router_security(args, environ=os.environ) -> ServerSecurity:
    """The router's server security: mutual TLS, Sessions from the engine
    identities, ProbeAdmin by admin token and/or operator identity."""
    files = _pem_files(args)
    tokens = _token_set(args, ADMIN_TOKENS, environ)
    if files is None:
        return _plaintext(args, ADMIN_TOKENS, tokens)
    if args.engine_identities is None:
        raise SecurityConfigError(
            "--engine-identities: required with TLS (the certificate identities allowed to open "
            "Sessions, e.g. the engine certificate's DNS name)"
        )
    if tokens is None and args.admin_identities is None:
        raise SecurityConfigError(
            f"{ADMIN_TOKENS.flag}: ProbeAdminService needs admin tokens "
            f"({ADMIN_TOKENS.flag} or ${ADMIN_TOKENS.env_var}), --admin-identities, or both "
            "(or --insecure for development)"
        )
    access = {
        PROBE_ROUTER_SERVICE: Access(identities=args.engine_identities),
        PROBE_ADMIN_SERVICE: Access(tokens=tokens, identities=args.admin_identities),
    }
    return ServerSecurity(_server_tls(files, require_client_cert=True), access, args.reflection)
