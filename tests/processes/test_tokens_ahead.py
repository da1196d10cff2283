"""--max-tokens-ahead in real processes (engine, vLLM and a router): vLLM's
scheduler holds a probed request one position past its first unsettled one, so
an abort lands at most one token after its trigger whatever the load, and a
router that stops reading stops its requests until it reads again.

One worker only: under pipeline parallelism the scheduler's hold is tested in
tests/capture/test_tokens_ahead_scheduler.py, but a request in lockstep with
its router here met a router whose Session stopped reading its socket for 7-10 s
while its event loop ran (docs/engine.md, `--max-tokens-ahead`)."""

from __future__ import annotations

import asyncio
import signal
from contextlib import asynccontextmanager

import pytest
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

from tools import stack
from tools.aborts import PROMPTS, ROUTER_TIMEOUT_S, arm, request

pytestmark = pytest.mark.vllm

AHEAD = 1
# How long the router stays stopped: long enough for the tiny model to finish
# the request many times over (it decodes hundreds of tokens a second here),
# well inside the router timeout, after which a fail_closed request would end.
STOPPED_S = 2.0
# A router starved of CPU: stopped this long, then running this long, in turn.
SLOW_STOP_S, SLOW_RUN_S = 0.03, 0.005


@pytest.fixture(scope="module")
async def held_stack(tiny_llama_path, tmp_path_factory):
    router = stack.router(stack.free_port(), tmp_path_factory.mktemp("probes")).start()
    engine = stack.engine(tiny_llama_path, router.address, "--max-tokens-ahead", str(AHEAD),
                          router_timeout_s=ROUTER_TIMEOUT_S).start()
    try:
        await router.wait_health(want_serving=None, timeout=60)
        await engine.wait_health(want_serving=True, timeout=300)
        async with stack.channel(engine.address) as ch:
            armed = await arm("ahead", engine_pb_grpc.EngineServiceStub(ch), router.address)
            yield armed, router
    finally:
        engine.kill()
        router.kill()


@asynccontextmanager
async def starved(router: stack.Service):
    """The router runs SLOW_RUN_S in every SLOW_STOP_S + SLOW_RUN_S (SIGSTOP and
    SIGCONT), as a router waiting for a CPU does: without the bound, vLLM
    generates a token every few ms meanwhile."""
    async def cycle() -> None:
        while True:
            router.process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(SLOW_STOP_S)
            router.process.send_signal(signal.SIGCONT)
            await asyncio.sleep(SLOW_RUN_S)

    task = asyncio.create_task(cycle())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.process.send_signal(signal.SIGCONT)


async def test_every_abort_lands_within_the_bound_after_its_trigger_however_slow_the_router(held_stack):
    """Three pairs with the router starved, each abort within AHEAD tokens of
    its trigger; the other request of each pair is held as often and still
    finishes with the tokens it has without any bound."""
    armed, router = held_stack
    latencies = []
    async with starved(router):
        for number in range(3):
            aborted, other = await armed.probed_pair(f"bounded-{number}")
            latencies.append(armed.check_abort(aborted))
            assert other.reason == "LENGTH" and other.tokens == armed.baseline[1].tokens, other.finished
    print(f"{armed.name}: abort latency {latencies} tokens after the triggering token")
    assert max(latencies) <= AHEAD, latencies


async def test_a_router_that_stops_reading_stops_its_requests_until_it_reads_again(held_stack):
    armed, router = held_stack
    outcome = stack.Outcome()
    stream = asyncio.create_task(stack.generate(
        armed.engine, request(PROMPTS[1], f"{armed.name}-stopped-router", probes=[armed.binding]),
        outcome=outcome))
    async with asyncio.timeout(60):
        while len(outcome.tokens) < 3:  # its first rows were scored
            assert not stream.done(), stream
            await asyncio.sleep(0.005)
    router.process.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(0.5)  # what was in flight when the router stopped arrives
        before = len(outcome.tokens)
        await asyncio.sleep(STOPPED_S)
        during = len(outcome.tokens) - before
    finally:
        router.process.send_signal(signal.SIGCONT)
    await stream
    print(f"{armed.name}: {before} tokens when the router stopped, {during} more in {STOPPED_S} s stopped")
    assert before < len(armed.baseline[1].tokens)
    assert during == 0
    assert outcome.reason == "LENGTH" and outcome.tokens == armed.baseline[1].tokens, outcome.finished
    assert outcome.finished.unprobed_tokens == 0
