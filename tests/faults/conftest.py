"""One engine process for the fault package, reaching its router through a
loopback TCP proxy (tools/tcp_proxy.py). Each test points the proxy at the
router it needs (a real router process, or a small real gRPC router in this
process), then injects its fault: SIGKILL, SIGSTOP, a blackhole, errors, a
router too slow for the send queue. The engine starts once (~35-60 s here)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tests.faults import harness
from tools import stack
from tools.tcp_proxy import TcpProxy
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm

# Batches per replica the engine may queue for a router that does not read.
SEND_QUEUE = 8


@pytest.fixture(scope="package")
async def proxy():
    async with TcpProxy(target=f"127.0.0.1:{stack.free_port()}") as running:
        yield running


@pytest.fixture(scope="package")
def engine_metrics_port() -> int:
    return stack.free_port()


@pytest.fixture(scope="package")
async def engine_service(tiny_llama_path, proxy, engine_metrics_port):
    service = stack.processes.engine(
        tiny_llama_path, proxy.address, "--router-timeout", str(harness.ROUTER_TIMEOUT_S),
        "--router-heartbeat-timeout", str(harness.HEARTBEAT_TIMEOUT_S), "--max-num-seqs", "16", "--send-queue", str(SEND_QUEUE), "--overflow-policy", "drop_oldest",
        "--metrics-port", str(engine_metrics_port), max_model_len=1024,
    ).start()
    try:
        async with stack.channel(service.address) as channel:
            await stack.wait_model_info(engine_pb_grpc.EngineServiceStub(channel), service, timeout=400)
        yield service
    finally:
        service.kill()


@pytest.fixture
async def engine(engine_service):
    async with stack.channel(engine_service.address) as channel:
        yield engine_pb_grpc.EngineServiceStub(channel)


class RouterProcess:
    """A real router process with its metrics port; SIGSTOP/SIGCONT-able."""

    def __init__(self, service: stack.Service, metrics_port: int):
        self.service = service
        self.metrics_port = metrics_port
        self.stopped = False

    @property
    def address(self) -> str:
        return self.service.address

    def stop(self) -> None:
        self.service.process.send_signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self.service.process.send_signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.stopped:
            self.resume()
        self.service.kill()


@pytest.fixture
async def start_router(proxy, engine, tmp_path):
    """start_router(port=None) -> a real router process with the watch probe,
    the proxy pointed at it, its probe in the engine's catalog."""
    started: list[RouterProcess] = []

    async def start(port: int | None = None, wait_probe: bool = True) -> RouterProcess:
        directory = tmp_path / "probes"
        if not directory.exists():
            directory.mkdir()
            harness.write_watch_probe(directory)
        metrics_port = stack.free_port()
        service = stack.router(port or stack.free_port(), directory,
                               "--metrics-port", str(metrics_port)).start()
        router = RouterProcess(service, metrics_port)
        started.append(router)
        await service.wait_health(want_serving=True, timeout=60)
        if proxy.target != service.address:
            proxy.retarget(service.address)
        if wait_probe:
            await stack.wait_for_probe(engine, harness.WATCH)
            await harness.wait_router_state(metrics_port, sessions=1)
        return router

    yield start
    for router in started:
        router.kill()
    proxy.drop_connections()
    await asyncio.sleep(0)
