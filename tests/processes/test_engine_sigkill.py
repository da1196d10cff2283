"""An engine SIGKILLed while its requests run: the router frees their state and
the session within a stated time, and keeps serving the other engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e import stack
from tests.faults import harness
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

pytestmark = pytest.mark.vllm

# A killed process's sockets close at once (the kernel sends FIN/RST); the
# router frees a session's requests when its stream ends. 3 s covers a loaded machine.
ROUTER_FREES_WITHIN_S = 3.0


async def test_engine_sigkill_frees_router_state(tiny_llama_path, tmp_path):
    harness.write_watch_probe(tmp_path)
    metrics_port = stack.free_port()
    router = stack.router(stack.free_port(), tmp_path, "--metrics-port", str(metrics_port)).start()
    # Two engines start together (their start-up overlaps): one is killed, the other keeps going.
    doomed = stack.engine(tiny_llama_path, router.address, max_model_len=1024).start()
    survivor = stack.engine(tiny_llama_path, router.address, max_model_len=1024).start()
    try:
        await router.wait_health(want_serving=True, timeout=60)
        async with stack.channel(doomed.address) as doomed_channel, \
                stack.channel(survivor.address) as survivor_channel:
            doomed_stub = pb_grpc.EngineServiceStub(doomed_channel)
            survivor_stub = pb_grpc.EngineServiceStub(survivor_channel)
            for stub, service in ((doomed_stub, doomed), (survivor_stub, survivor)):
                await stack.wait_model_info(stub, service)
                await stack.wait_for_probe(stub, harness.WATCH, timeout=120)
            await harness.wait_router_state(metrics_port, sessions=2, live_requests=0)

            policies = [pb.FAILURE_POLICY_FAIL_CLOSED, pb.FAILURE_POLICY_FAIL_OPEN] * 2
            running = []
            for i, policy in enumerate(policies):
                progress = stack.Outcome()
                task = asyncio.create_task(stack.generate(
                    doomed_stub, harness.request(f"doomed-{i}", policy, 900), outcome=progress))
                running.append((task, progress))
            kept = asyncio.create_task(stack.generate(
                survivor_stub, harness.request("kept", pb.FAILURE_POLICY_FAIL_CLOSED, 300)))
            for _, progress in running:
                await harness.wait_tokens(progress, 5)
            values = await harness.metrics(metrics_port)
            assert values["undercurrent_router_live_requests"] >= len(policies)

            killed_at = time.monotonic()
            doomed.kill()
            freed = await harness.wait_router_state(
                metrics_port, sessions=1, live_requests=0 if kept.done() else 1,
                timeout=ROUTER_FREES_WITHIN_S)
            print(f"engine SIGKILL: router state freed {freed:.2f} s after the kill "
                  f"({time.monotonic() - killed_at:.2f} s incl. scrape)")
            for task, _ in running:
                with pytest.raises(Exception):
                    await task  # the stream died with its engine

            # The router keeps serving the other engine, every row scored.
            outcome = await kept
            assert outcome.reason == "LENGTH" and outcome.finished.unprobed_tokens == 0
            assert len(harness.scored_positions(outcome)) == 299
            again = await stack.generate(
                survivor_stub, harness.request("after-kill", pb.FAILURE_POLICY_FAIL_CLOSED, 12))
            assert again.reason == "LENGTH" and len(harness.scored_positions(again)) == 11
            await harness.wait_router_state(metrics_port, sessions=1, live_requests=0)
    finally:
        doomed.kill()
        survivor.kill()
        router.kill()
