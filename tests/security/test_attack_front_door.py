"""Attack: exhaust a service's memory without a token.

gRPC reads a whole unary request before any handler runs, so calls that the
token check then refused used to cost their full size: four 60 MiB LoadProbe
calls without a token took a router from 142 to 353 MiB. Here many such calls
go at once over many connections, to the engine's client port (no client
certificate needed there) and to a router (a CA certificate that is not an
operator's, no admin token), while an authenticated caller is served; the
target's RSS must stay within MEMORY_BOUND of where it started.

The bound: a refused call's message is never read, so each stream buffers at
most its initial 64 KiB flow-control window (BDP probing is off, so windows do
not grow for unread streams); CALLS x 64 KiB is 1 MiB here, and the rest of
the bound is the handlers, buffers and allocator noise of that many calls
(measured below 10 MiB, see the test's output). Before the front door, the
engine buffered every message whole: CALLS x 60 MiB.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from common.security.auth import READ_TIMEOUT_S
from tests.router.helpers import HIDDEN
from tests.router.test_admin import inline
from tests.security.attacks import MIB, MemoryWatch, channels, flood
from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

CALLS = 16
CONNECTIONS = 8
MESSAGE_BYTES = 60 * MIB
MEMORY_BOUND = 32 * MIB
GENERATE = "/undercurrent.v1.EngineService/Generate"
LOAD_PROBE = "/undercurrent.v1.ProbeAdminService/LoadProbe"


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.vllm
async def test_large_unauthenticated_calls_leave_the_engine_within_its_bound_and_callers_served(
        attacked_engine, capsys):
    dev = DevSecurity.ensure()
    huge = engine_pb.GenerateRequest(text="x" * MESSAGE_BYTES).SerializeToString()
    ca_only = grpc.ssl_channel_credentials(dev.ca.read_bytes())  # what any client of the engine has
    attackers = channels(attacked_engine.service.address, CONNECTIONS, ca_only)
    request = engine_pb.GenerateRequest(text="Still served", sampling=engine_pb.SamplingParams(max_tokens=48, ignore_eos=True))
    async with stack.channel(attacked_engine.service.address) as honest:
        engine = engine_pb_grpc.EngineServiceStub(honest)
        await engine.GetModelInfo(engine_pb.GetModelInfoRequest())
        async with MemoryWatch(attacked_engine.pid) as watch:
            served = asyncio.create_task(stack.generate(engine, request))
            no_token, oversized = [], []
            while not served.done():  # wave after wave for as long as the honest request runs
                no_token += await flood(attackers, GENERATE, huge, CALLS, streaming_response=True)
                # A caller with a valid token cannot send more than the port needs either.
                oversized += await flood(attackers, GENERATE, huge, CALLS, bearer(dev.client_token),
                                         streaming_response=True)
            outcome = await served
    for channel in attackers:
        await channel.close()
    with capsys.disabled():
        print(f"\nengine under {len(no_token) + len(oversized)} calls of 60 MiB: {watch.cost}")
    assert set(no_token) == {"UNAUTHENTICATED"} and set(oversized) == {"RESOURCE_EXHAUSTED"}
    assert outcome.reason == "LENGTH" and len(outcome.tokens) == 48
    assert watch.cost.rise < MEMORY_BOUND, watch.cost


async def test_large_calls_without_an_admin_token_leave_a_router_within_its_bound(start_router_process, capsys):
    router = await start_router_process()
    dev = DevSecurity.ensure()
    # The engine's own certificate: it gets through mutual TLS, but holds no admin token.
    engine_cert, engine_key = dev.pem("engine")
    credentials = grpc.ssl_channel_credentials(dev.ca.read_bytes(), engine_key.read_bytes(),
                                               engine_cert.read_bytes())
    huge = admin_pb.LoadProbeRequest(inline=admin_pb.InlineProbe(manifest_json="{}",
                                                     weights_safetensors=b"\0" * MESSAGE_BYTES)).SerializeToString()
    attackers = channels(router.service.address, CONNECTIONS, credentials)
    async with router.service.channel() as channel:
        admin = admin_pb_grpc.ProbeAdminServiceStub(channel)
        async with MemoryWatch(router.pid) as watch:
            flooding = asyncio.create_task(flood(attackers, LOAD_PROBE, huge, CALLS * 2))
            listed = await admin.ListProbes(admin_pb.ListProbesRequest())  # the operator meanwhile
            loaded = await admin.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("during", np.ones(HIDDEN))))
            codes = await flooding
    for channel in attackers:
        await channel.close()
    with capsys.disabled():
        print(f"\nrouter under {len(codes)} calls of 60 MiB without an admin token: {watch.cost}")
    assert set(codes) == {"UNAUTHENTICATED"}
    assert [p.name for p in listed.probes] == ["p"] and loaded.probe.name == "during"
    assert watch.cost.rise < MEMORY_BOUND, watch.cost


async def test_a_call_whose_message_never_comes_is_ended_within_the_read_timeout(start_router_process):
    """Health needs no credential; a caller that opens Check calls and never
    sends their message must not hold the router's handlers for ever."""
    router = await start_router_process()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.health_port}") as channel:
        never = asyncio.Event()

        async def nothing():
            await never.wait()
            yield b""  # pragma: no cover

        started = asyncio.get_running_loop().time()
        stalled = [channel.stream_unary("/grpc.health.v1.Health/Check")(nothing(), timeout=READ_TIMEOUT_S * 3)
                   for _ in range(8)]
        codes = []
        for call in stalled:
            try:
                await call
            except grpc.aio.AioRpcError as err:
                codes.append((err.code().name, err.details()))
        took = asyncio.get_running_loop().time() - started
    assert codes == [("DEADLINE_EXCEEDED", f"the request message did not arrive within {READ_TIMEOUT_S:g} s")] * 8
    assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S * 2
