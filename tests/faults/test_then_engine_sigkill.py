"""The package's engine SIGKILLed while its requests run: the router frees their
state and the session within a stated time, and serves a new engine.

Kills the package's shared engine, so this module must run after every other
one here (pytest runs modules in name order: keep its name sorting last)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.faults import harness
from tools import stack
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm

# A killed process's sockets close at once (the kernel ends its connections);
# the router frees a session's requests when its stream ends. 3 s covers a loaded machine.
ROUTER_FREES_WITHIN_S = 3.0


async def test_engine_sigkill_frees_router_state(engine_service, engine, start_router,
                                                 tiny_llama_path):
    router = await start_router()
    policies = [types_pb.FAILURE_POLICY_FAIL_CLOSED, types_pb.FAILURE_POLICY_FAIL_OPEN] * 2
    running = []
    for i, policy in enumerate(policies):
        progress = stack.Outcome()
        task = asyncio.create_task(stack.generate(
            engine, harness.request(f"doomed-{i}", policy, 900), outcome=progress))
        running.append((task, progress))
    for _, progress in running:
        await harness.wait_tokens(progress, 5)
    values = await harness.metrics(router.metrics_port)
    assert values["undercurrent_router_live_requests"] == len(policies)
    assert values["undercurrent_router_sessions"] == 1

    engine_service.kill()
    freed = await harness.wait_router_state(router.metrics_port, sessions=0, live_requests=0,
                                            timeout=ROUTER_FREES_WITHIN_S)
    print(f"engine SIGKILL: router state freed {freed:.2f} s after the kill")
    for task, _ in running:
        with pytest.raises(Exception):
            await task  # the stream died with its engine

    # The router serves a new engine, every row scored.
    fresh = stack.engine(tiny_llama_path, router.address, max_model_len=1024).start()
    try:
        async with stack.channel(fresh.address) as channel:
            stub = engine_pb_grpc.EngineServiceStub(channel)
            await stack.wait_model_info(stub, fresh, timeout=400)
            await stack.wait_for_probe(stub, harness.WATCH, timeout=120)
            outcome = await stack.generate(
                stub, harness.request("new-engine", types_pb.FAILURE_POLICY_FAIL_CLOSED, 12))
        assert outcome.reason == "LENGTH" and outcome.finished.unprobed_tokens == 0
        assert len(stack.scored_positions(outcome)) == 11
        await harness.wait_router_state(router.metrics_port, sessions=1, live_requests=0)
    finally:
        fresh.kill()
