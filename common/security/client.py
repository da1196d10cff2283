"""Client credentials for tools that call the services (the lifecycle commands,
scripts): TLS and bearer tokens from the environment, plaintext without them.
`undercurrent_client.connection.from_env` reads these variables:

  UNDERCURRENT_TLS_CA                 CA the server's certificate must chain to (TLS when set)
  UNDERCURRENT_TLS_CERT, _TLS_KEY     client certificate and key (routers require one)
  UNDERCURRENT_TOKEN                  bearer token for EngineService (a client token)
  UNDERCURRENT_ADMIN_TOKEN            bearer token for ProbeAdminService (an admin token)
  UNDERCURRENT_TOKEN_FILE,            files holding those tokens (a mounted secret), read
  UNDERCURRENT_ADMIN_TOKEN_FILE       when the variables above are not set

Tokens are sent over TLS only: without UNDERCURRENT_TLS_CA the channel is
plaintext and carries no token.

(The services read their token *sets* from UNDERCURRENT_CLIENT_TOKENS and
UNDERCURRENT_ADMIN_TOKENS; these singular names are one caller's own tokens.)
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc


ADMIN_SERVICE = "undercurrent.v1.ProbeAdminService"
ENV_CA, ENV_CERT, ENV_KEY = "UNDERCURRENT_TLS_CA", "UNDERCURRENT_TLS_CERT", "UNDERCURRENT_TLS_KEY"
ENV_TOKEN, ENV_ADMIN_TOKEN = "UNDERCURRENT_TOKEN", "UNDERCURRENT_ADMIN_TOKEN"
FILE_SUFFIX = "_FILE"


def token_from_env(name: str, environ=os.environ) -> str | None:
    """$NAME, else the content of the file $NAME_FILE names (stripped)."""
    if environ.get(name):
        return environ[name]
    path = environ.get(name + FILE_SUFFIX)
    return Path(path).read_text().strip() or None if path else None


class ServiceTokens(grpc.AuthMetadataPlugin):
    """Sends `authorization: Bearer ...` on every call: the admin token to
    ProbeAdminService, the client token to everything else (health ignores it)."""

    def __init__(self, client: str | None, admin: str | None):
        self.client, self.admin = client, admin

    def __call__(self, context, callback):
        token = self.admin if context.service_url.endswith(ADMIN_SERVICE) else self.client
        callback((("authorization", f"Bearer {token}"),) if token else (), None)


def tls_credentials(ca: Path, cert: Path | None, key: Path | None, client_token: str | None,
                    admin_token: str | None) -> grpc.ChannelCredentials:
    tls = grpc.ssl_channel_credentials(
        ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
    )
    tokens = grpc.metadata_call_credentials(ServiceTokens(client_token, admin_token), "undercurrent-tokens")
    return grpc.composite_channel_credentials(tls, tokens)
