"""Rows that capture loses without a word, in real vLLM: the engine notices on its own.

A real vLLM engine with capture (the capture suite's shared one), the engine
runtime and router link of the engine service, and a router double on
loopback. The fault: every row of one position vanishes between the workers
and the runtime, as a capture bug (a wrong duplicate filter, a lost shipment)
would lose it without reporting it. The runtime counts rows against what
capture must make, so a gated fail_closed request stops before that position
and a fail_open one counts it unprobed; neither shows it as scored.
"""

from __future__ import annotations

import asyncio

import pytest
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

from engine_service.link import RouterLinkConfig
from engine_service.service.runtime import EngineRuntime, EngineSettings
from tests.capture.conftest import HELD_AHEAD
from tests.capture.workloads import prompt
from tests.engine_link.helpers import FAST, until
from tools.router_double import PROBE, RouterDouble, of_client

pytestmark = pytest.mark.vllm

PROMPT = prompt(6, 7)
LOST = len(PROMPT) + 4  # generated token 5 is sampled here
MAX_TOKENS = 10


class LosingOnePosition:
    """The started capture controller, except that its drains lose every row of
    `position` for every request, reporting nothing."""

    def __init__(self, controller, position: int) -> None:
        self._controller = controller
        self.position = position
        self.lost_rows = 0

    def __getattr__(self, name):
        return getattr(self._controller, name)

    async def start(self) -> types_pb.ModelInfo:
        return self._controller.model_info()  # the shared engine's controller is started

    async def drain(self):
        kept = []
        for block in await self._controller.drain():
            lost = block.token_positions == self.position
            self.lost_rows += int(lost.sum())
            if not lost.all():
                kept.append(block.select(~lost))
        return kept


@pytest.fixture
async def runtime_losing_rows(llama_engine):
    engine, controller = llama_engine
    router = await RouterDouble("r", threshold=1e9).start()  # scores every row, never aborts
    capture = LosingOnePosition(controller, LOST)
    config = RouterLinkConfig(targets=router.address, engine_id="engine-loss", **{**FAST, "router_timeout_s": 5.0})
    runtime = EngineRuntime(engine, capture, link_config=config, settings=EngineSettings(router_timeout_s=5.0))
    await runtime.start()
    try:
        await runtime.link.wait_ready(timeout=10)
        yield runtime, capture, router
        await until(lambda: not runtime.active and runtime.link.live_requests() == 0, timeout=10)
    finally:
        await runtime.close()
        await router.kill()


def generate_request(request_id: str, policy: int) -> engine_pb.GenerateRequest:
    return engine_pb.GenerateRequest(
        request_id=request_id,
        token_ids=engine_pb.TokenIds(ids=PROMPT),
        sampling=engine_pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        gate_tokens=True,
        probes=[types_pb.ProbeBinding(probe=PROBE.name, failure_policy=policy)],
    )


async def run(runtime: EngineRuntime, message: engine_pb.GenerateRequest) -> tuple[list[int], engine_pb.GenerateFinished]:
    responses = [response async for response in runtime.generate(message)]
    tokens = [t for r in responses if r.HasField("tokens") for t in r.tokens.token_ids]
    assert responses[-1].HasField("finished")
    return tokens, responses[-1].finished


async def test_real_capture_losing_a_positions_rows_stops_a_gated_fail_closed_request_there(runtime_losing_rows):
    runtime, capture, router = runtime_losing_rows
    # The same greedy request, fail_open, shows every token: what fail_closed must cut short.
    all_tokens, open_finish = await run(runtime, generate_request("loss-open", types_pb.FAILURE_POLICY_FAIL_OPEN))
    assert open_finish.finish_reason == types_pb.FINISH_REASON_LENGTH and len(all_tokens) == MAX_TOKENS
    # The probe reads layer 0 of the residual stream: one row per position, and one was lost.
    assert capture.lost_rows == 1
    assert (open_finish.unprobed_tokens, open_finish.dropped_records) == (1, 1)
    assert open_finish.message.startswith("1 tokens unprobed (fail_open): capture delivered no rows")
    assert LOST not in of_client(router.requests, "loss-open").positions

    tokens, finished = await run(runtime, generate_request("loss-closed", types_pb.FAILURE_POLICY_FAIL_CLOSED))
    assert capture.lost_rows == 2
    assert finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE
    assert finished.verdict.token_position == LOST
    assert "capture delivered no rows or too few at 1 position(s), 1 rows missing" in finished.message
    # Every token before the lost position, none from it on: the token sampled
    # at LOST and those after it were never shown.
    assert tokens == all_tokens[: LOST - len(PROMPT)]
    assert (finished.unprobed_tokens, finished.dropped_records) == (1, 1)
    assert runtime.metrics.registry.get_sample_value(
        "undercurrent_engine_dropped_records_total", {"queue": "capture_lost"}) == 2


# -- the same loss with --max-tokens-ahead: vLLM holds the request at the lost rows --

HELD_ROUTER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
async def held_runtime_losing_rows(held_llama_engine):
    """The runtime on the engine whose scheduler holds requests HELD_AHEAD
    positions past their first unsettled one, telling it how far."""
    engine, controller, allowances = held_llama_engine
    router = await RouterDouble("r", threshold=1e9).start()
    capture = LosingOnePosition(controller, LOST)
    config = RouterLinkConfig(targets=router.address, engine_id="engine-held-loss",
                              **{**FAST, "router_timeout_s": HELD_ROUTER_TIMEOUT_S})
    runtime = EngineRuntime(engine, capture, link_config=config, allowances=allowances,
                            settings=EngineSettings(router_timeout_s=HELD_ROUTER_TIMEOUT_S))
    await runtime.start()
    try:
        await runtime.link.wait_ready(timeout=10)
        yield runtime, capture
    finally:
        await runtime.close()
        await router.kill()


async def test_a_request_held_on_rows_capture_lost_is_ended_not_left_waiting(held_runtime_losing_rows):
    """vLLM holds the request once it computed HELD_AHEAD positions past the lost one,
    so only the engine's own watch can end it: after the router timeout plus a
    margin without progress it declares the rows lost, as at a request's end."""
    runtime, capture = held_runtime_losing_rows
    async with asyncio.timeout(60):  # a request held for good would hang here
        tokens, finished = await run(runtime, generate_request("held-closed", types_pb.FAILURE_POLICY_FAIL_CLOSED))
    assert capture.lost_rows == 1
    assert finished.finish_reason == types_pb.FINISH_REASON_ROUTER_UNAVAILABLE, finished
    assert finished.verdict.token_position == LOST
    assert "capture delivered no rows or too few at 1 position(s), 1 rows missing" in finished.message
    # Positions up to LOST were computed, then HELD_AHEAD more: the token sampled at
    # each. Without the hold vLLM runs to MAX_TOKENS first.
    assert finished.generated_tokens == LOST + HELD_AHEAD - len(PROMPT) + 1 < MAX_TOKENS
    assert len(tokens) == LOST - len(PROMPT)  # none at or after the lost position is shown
    assert (finished.unprobed_tokens, finished.dropped_records) == (1, 1)
    assert runtime.metrics.registry.get_sample_value(
        "undercurrent_engine_dropped_records_total", {"queue": "capture_lost"}) == 1


async def test_a_fail_open_request_held_on_lost_rows_goes_on_once_they_are_declared_lost(held_runtime_losing_rows):
    runtime, _ = held_runtime_losing_rows
    async with asyncio.timeout(60):
        tokens, finished = await run(runtime, generate_request("held-open", types_pb.FAILURE_POLICY_FAIL_OPEN))
    assert finished.finish_reason == types_pb.FINISH_REASON_LENGTH and len(tokens) == MAX_TOKENS
    assert (finished.unprobed_tokens, finished.dropped_records) == (1, 1)
    assert finished.message.startswith("1 tokens unprobed (fail_open): capture delivered no rows")
