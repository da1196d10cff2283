import numpy as np
import pytest

from common.security.auth import Access
from common.security.config import PROBE_ADMIN_SERVICE, PROBE_ROUTER_SERVICE, ServerSecurity
from common.security.tls import ServerTLS
from common.security.tokens import TokenSet
from tests.router.helpers import HIDDEN, linear_probe
from tests.router.conftest import make_router  # noqa: F401  (the fixture)
from tests.security.certs import CertFactory

ADMIN_TOKEN = "admin-token-0123456789abcdef"
CLIENT_TOKEN = "client-token-0123456789abcdef"
ENGINE_IDENTITY = "engine"


@pytest.fixture
def pki(tmp_path) -> CertFactory:
    """The deployment's CA."""
    return CertFactory(tmp_path / "pki")


@pytest.fixture
def rogue(tmp_path) -> CertFactory:
    """Another CA, trusted by nobody here."""
    return CertFactory(tmp_path / "rogue", "rogue CA")


@pytest.fixture
def probes_dir(tmp_path):
    linear_probe(tmp_path / "probes", "p", np.ones(HIDDEN))
    return tmp_path / "probes"


@pytest.fixture
def secure_router(make_router, pki, probes_dir):
    """secure_router(dns_names=..., ip_addresses=...) -> (router, its ServerTLS): a
    router with mutual TLS (client certificates from `pki`), Sessions from the
    `engine` identity and admin tokens."""

    async def start(stem="router", dns_names=("localhost",), ip_addresses=("127.0.0.1",)):
        tls = ServerTLS(pki.files(stem, dns_names=dns_names, ip_addresses=ip_addresses),
                        require_client_cert=True)
        access = {PROBE_ADMIN_SERVICE: Access(tokens=TokenSet.of("admin", {ADMIN_TOKEN: "operator"})),
                  PROBE_ROUTER_SERVICE: Access(identities=frozenset({ENGINE_IDENTITY}))}
        router = await make_router(probes_dir, security=ServerSecurity(tls, access))
        return router, tls

    return start

