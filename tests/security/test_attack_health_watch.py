"""Attack: flood Health.Watch, which needs no token or certificate.

Watch used to fail INTERNAL on every call (the error mapping iterated
grpc_health's coroutine as a generator), writing a traceback at ERROR each
time: 5,000 calls gave 4,671 tracebacks. Now every Watch answers with the
status and follows it; open watchers are capped; and every INTERNAL log line
is rate-limited whatever makes a handler fail.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import DEFAULT_MAX_HEALTH_WATCHERS, SERVICE_FULL_NAMES, start_server
from tools.dev_security import DevSecurity
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

WATCH_CALLS = 5000
BATCH = 50
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def first_status(stub) -> str:
    """Opens a Watch, takes its first answer and leaves (the status name, or the error code)."""
    call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    try:
        reply = await call.read()
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as err:
        return err.code().name
    finally:
        call.cancel()


@pytest.mark.vllm
async def test_a_watch_flood_on_the_engine_is_answered_capped_and_leaves_no_trace_in_its_log(attacked_engine):
    log_before = attacked_engine.service.log_path.read_text(errors="replace")
    # Anyone who can reach the port: the CA to trust, nothing else.
    credentials = grpc.ssl_channel_credentials(DevSecurity.ensure().ca.read_bytes())
    async with grpc.aio.secure_channel(attacked_engine.service.address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answers = []
        for _ in range(WATCH_CALLS // BATCH):
            answers += await asyncio.gather(*(first_status(stub) for _ in range(BATCH)))
        # Watchers held open: up to the cap, then RESOURCE_EXHAUSTED.
        held = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(DEFAULT_MAX_HEALTH_WATCHERS)]
        firsts = [await call.read() for call in held]
        refused = await first_status(stub)
        for call in held:
            call.cancel()
        await asyncio.sleep(0.5)
        again = await first_status(stub)  # the cap counts open watchers only
    assert answers == ["SERVING"] * WATCH_CALLS
    assert [r.status for r in firsts] == [SERVING] * DEFAULT_MAX_HEALTH_WATCHERS
    assert (refused, again) == ("RESOURCE_EXHAUSTED", "SERVING")
    logged = attacked_engine.service.log_path.read_text(errors="replace")[len(log_before):]
    assert "Traceback" not in logged and " ERROR " not in logged, logged[-3000:]


async def test_watch_follows_a_routers_status_on_its_loopback_health_port(start_router_process):
    """Through the plaintext health port a container's health check uses (no
    certificate): SERVING while the router has a probe, NOT_SERVING once the
    last one is unloaded."""
    router = await start_router_process()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.health_port}") as plaintext:
        call = health_pb2_grpc.HealthStub(plaintext).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        first = await call.read()
        async with router.service.channel() as channel:
            await admin_pb_grpc.ProbeAdminServiceStub(channel).UnloadProbe(admin_pb.UnloadProbeRequest(name="p"))
        second = await call.read()
        call.cancel()
    assert (first.status, second.status) == (SERVING, NOT_SERVING)


class Broken(engine_pb_grpc.EngineServiceServicer):
    async def GetModelInfo(self, request, context):
        raise ZeroDivisionError("a bug a caller can trigger at will")


async def test_a_handler_failing_on_every_call_logs_one_traceback_per_interval(caplog):
    caplog.set_level(logging.ERROR, logger="common.errors")
    handle = await start_server(
        [(engine_pb_grpc.add_EngineServiceServicer_to_server, Broken(), SERVICE_FULL_NAMES["EngineService"])],
        "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = engine_pb_grpc.EngineServiceStub(channel)

            async def call() -> str:
                try:
                    await stub.GetModelInfo(engine_pb.GetModelInfoRequest(), timeout=30)
                except grpc.aio.AioRpcError as err:
                    return err.code().name
                return "OK"

            codes = []
            for _ in range(10):
                codes += await asyncio.gather(*(call() for _ in range(100)))
    finally:
        await handle.stop(None)
    assert codes == ["INTERNAL"] * 1000
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and tracebacks[0].exc_info[0] is ZeroDivisionError
