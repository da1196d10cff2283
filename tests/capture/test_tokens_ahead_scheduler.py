"""--max-tokens-ahead's scheduler inside real vLLM, at one worker and under
pipeline parallelism (vLLM's batch queue): a bounded request stops at its
allowance while an unbounded one beside it runs to its end, waits there, and
goes on, to the same tokens, each time the engine service raises it. The
allowances come straight from the test here; tests/processes/test_tokens_ahead.py
runs the whole path with a router."""

from __future__ import annotations

import asyncio

import pytest

from engine_service.engine_core.tokens_ahead import AllowancePublisher
from engine_service.request.run import run_key
from tests.capture.conftest import HELD_AHEAD
from tests.capture.workloads import prompt
from tools.capture_engines import capture_engine

pytestmark = pytest.mark.vllm

AHEAD = HELD_AHEAD
PROMPT = prompt(9, 3)
MAX_TOKENS = 16
# Long enough for the tiny model to generate every token of the request several
# times over, had the scheduler not held it.
HELD_S = 0.5


@pytest.fixture(scope="module")
async def held_pp2_engine(tiny_llama_path):
    allowances = AllowancePublisher(AHEAD)
    async with capture_engine(tiny_llama_path, pp=2, allowances=allowances) as (engine, controller):
        yield engine, controller, allowances
    allowances.close()


@pytest.fixture(scope="module", params=["tp1", "pp2"])
def held_engine(request):
    """(engine, allowances): one worker is the capture suite's held engine; PP=2
    one of this module's own. Resolved here, synchronously, because async
    fixtures cannot request fixtures by name."""
    engine, _, allowances = request.getfixturevalue(
        "held_llama_engine" if request.param == "tp1" else "held_pp2_engine")
    return engine, allowances


def sampling(**extra):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA, **extra)


async def until_count(tokens: list, count: int, stream: asyncio.Task) -> None:
    async with asyncio.timeout(30):
        while len(tokens) < count:
            assert not stream.done(), stream
            await asyncio.sleep(0.01)


async def test_a_bounded_request_waits_at_each_allowance_and_ends_with_the_same_tokens(held_engine):
    from vllm.inputs import TokensPrompt

    engine, allowances = held_engine
    key = run_key("held", 1)
    tokens: dict[str, list[int]] = {"held": [], "free": []}

    async def run(request_id: str, params) -> None:
        async for output in engine.generate(TokensPrompt(prompt_token_ids=PROMPT), params, request_id):
            tokens[request_id] += output.outputs[0].token_ids

    held = asyncio.create_task(run("held", sampling(extra_args=allowances.extra_args(key))))
    free = asyncio.create_task(run("free", sampling()))
    await asyncio.wait_for(free, 60)
    assert len(tokens["free"]) == MAX_TOKENS
    # Its first allowance: the prompt and AHEAD positions past it, so the tokens
    # sampled from the last prompt position and those AHEAD.
    await until_count(tokens["held"], AHEAD + 1, held)
    await asyncio.sleep(HELD_S)
    assert len(tokens["held"]) == AHEAD + 1
    allowances.allow(key, settled_below=len(PROMPT) + 4, prompt_tokens=len(PROMPT))
    await until_count(tokens["held"], 4 + AHEAD + 1, held)
    await asyncio.sleep(HELD_S)
    assert len(tokens["held"]) == 4 + AHEAD + 1
    allowances.allow(key, settled_below=len(PROMPT) + MAX_TOKENS, prompt_tokens=len(PROMPT))
    await asyncio.wait_for(held, 30)
    assert tokens["held"] == tokens["free"]
    allowances.forget(key)


async def test_an_ended_bounded_request_stays_held_until_vllm_aborts_it(held_engine):
    """The engine service forgets a request when it ends it (a verdict): the
    scheduler falls back to the first allowance, so vLLM computes nothing more
    while its abort is on the way."""
    from vllm.inputs import TokensPrompt

    engine, allowances = held_engine
    key = run_key("ended", 1)
    tokens: list[int] = []

    async def run() -> None:
        params = sampling(extra_args=allowances.extra_args(key))
        async for output in engine.generate(TokensPrompt(prompt_token_ids=PROMPT), params, "ended"):
            tokens.extend(output.outputs[0].token_ids)

    stream = asyncio.create_task(run())
    await until_count(tokens, AHEAD + 1, stream)
    allowances.allow(key, settled_below=len(PROMPT) + 3, prompt_tokens=len(PROMPT))
    await until_count(tokens, 3 + AHEAD + 1, stream)
    allowances.forget(key)
    await asyncio.sleep(HELD_S)
    assert len(tokens) == 3 + AHEAD + 1
    await engine.abort("ended")
    await asyncio.wait_for(stream, 30)
    assert len(tokens) == 3 + AHEAD + 1
