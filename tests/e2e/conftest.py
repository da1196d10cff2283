"""One engine process for the e2e package (start-up costs ~35 s), pointed at two router
ports; tests start, kill and restart router processes on those ports."""

from __future__ import annotations

import pytest

from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 1024  # the embedded models' max_position_embeddings


@pytest.fixture(autouse=True, scope="package")
def client_credentials():
    """The lifecycle commands take TLS files and tokens from the environment
    (common.security.client); the services here run with TLS."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in DevSecurity.ensure().client_env().items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="package")
def router_ports() -> tuple[int, int]:
    return stack.free_port(), stack.free_port()


@pytest.fixture(scope="package")
def engine_metrics_port() -> int:
    """The engine's Prometheus port: tests read its request counters from it."""
    return stack.free_port()


@pytest.fixture(scope="package")
async def engine_service(tiny_llama_path, router_ports, engine_metrics_port):
    service = stack.engine(
        tiny_llama_path, ",".join(f"127.0.0.1:{p}" for p in router_ports), "--max-num-seqs", "16",
        "--metrics-port", str(engine_metrics_port),
        # Room for requests long enough to outlive a router kill on a loaded machine.
        max_model_len=MAX_MODEL_LEN,
    ).start()
    try:
        async with stack.channel(service.address) as channel:
            await stack.wait_model_info(engine_pb_grpc.EngineServiceStub(channel), service)
        yield service
    finally:
        service.kill()


@pytest.fixture
async def engine(engine_service):
    async with stack.channel(engine_service.address) as channel:
        yield engine_pb_grpc.EngineServiceStub(channel)


@pytest.fixture
async def start_router(router_ports, tmp_path):
    """start_router(index, probes_dir=None, *flags) -> a router answering on router_ports[index]
    (NOT_SERVING until it has a probe)."""
    started: list[stack.Service] = []

    async def start(index: int = 0, probes_dir=None, *flags: str) -> stack.Service:
        directory = probes_dir or tmp_path / f"probes-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        service = stack.router(router_ports[index], directory, *flags).start()
        started.append(service)
        await service.wait_health(want_serving=None, timeout=60)
        return service

    yield start
    for service in started:
        service.kill()
