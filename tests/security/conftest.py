import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.security.auth import Access
from common.security.config import PROBE_ADMIN_SERVICE, PROBE_ROUTER_SERVICE, ServerSecurity
from common.security.tls import ServerTLS
from common.security.tokens import TokenSet
from tests.router.helpers import HIDDEN, linear_probe
from tests.router.conftest import make_router  # noqa: F401  (the fixture)
from tests.security.certs import CertFactory
from tools import processes, stack
from tools.dev_security import DevSecurity
from tools.processes import Service, free_port
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

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


# -- service processes the attacks in this folder aim at --------------------------------

MAX_STREAMS_PER_CALLER = 2
MAX_QUEUED_BYTES_PER_CALLER = 1024 * 1024


@dataclass
class Target:
    """A service process under attack, with the token file it checks (a copy the
    test may change) and its metrics port."""

    service: Service
    tokens_file: Path
    metrics_port: int
    health_port: int | None = None  # a router's plaintext loopback health port

    @property
    def pid(self) -> int:
        return self.service.process.pid

    async def wait_serving(self, timeout: float = 60) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            while True:
                assert self.service.process.poll() is None, self.service.log_tail()
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                            timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                assert asyncio.get_running_loop().time() < deadline, self.service.log_tail()
                await asyncio.sleep(0.2)


@pytest.fixture(scope="package")
async def attacked_engine(tiny_llama_path, tmp_path_factory) -> Target:
    """One engine process for the folder (vLLM starts in 35-100 s): TLS, client
    tokens from its own file, small per-caller quotas, metrics on their default
    (loopback) address, no routers."""
    tokens = tmp_path_factory.mktemp("engine") / "client-tokens"
    tokens.write_text((DevSecurity.ensure().directory / "client-tokens").read_text())
    metrics_port = free_port()
    service = processes.engine(
        tiny_llama_path, "", "--client-tokens-file", str(tokens), "--metrics-port", str(metrics_port),
        "--max-streams-per-caller", str(MAX_STREAMS_PER_CALLER),
        "--max-queued-bytes-per-caller", str(MAX_QUEUED_BYTES_PER_CALLER),
        "--max-num-seqs", "8", "--enable-prefix-caching", log_stats=True,
    ).start()
    try:
        async with service.channel() as channel:
            await stack.wait_model_info(engine_pb_grpc.EngineServiceStub(channel), service)
        yield Target(service, tokens, metrics_port)
    finally:
        service.kill()


@pytest.fixture
async def start_router_process(tmp_path):
    """start_router_process(*flags) -> a router process with TLS, the development
    certificates (flags may replace them), Sessions from the `engine` identity,
    admin tokens from its own file (tmp_path/admin-tokens) and probe `p` from
    tmp_path/probes; started once its loopback health port answers SERVING."""
    started: list[Target] = []

    async def start(*flags: str) -> Target:
        directory = tmp_path / "probes"
        if not directory.exists():
            linear_probe(directory, "p", np.ones(HIDDEN))
        tokens = tmp_path / "admin-tokens"
        tokens.write_text((DevSecurity.ensure().directory / "admin-tokens").read_text())
        metrics_port, health_port = free_port(), free_port()
        service = processes.router(free_port(), directory, "--admin-tokens-file", str(tokens),
                                   "--metrics-port", str(metrics_port), "--health-port", str(health_port),
                                   *flags).start()
        target = Target(service, tokens, metrics_port, health_port)
        started.append(target)
        await target.wait_serving()
        return target

    yield start
    for target in started:
        target.service.kill()
