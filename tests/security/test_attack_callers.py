"""Attack: one client token holder starves the others, or reads what they asked.

Streams: one caller could hold every one of the engine's --max-streams, so
everyone else got RESOURCE_EXHAUSTED. Queued bytes: a caller that stops
reading pinned up to --client-queue-bytes per stream (256 x 32 MiB). Prefix
cache: vLLM shared cached prompt blocks across callers, so a caller could learn
by timing whether another caller's prompt began as its own. Now each caller has
its own stream quota and queued-bytes budget, and its own prefix-cache salt.
One engine process with TLS and client tokens (`demo` attacks, `other` is
served); quotas 2 streams and 1 MiB per caller.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.security.conftest import MAX_QUEUED_BYTES_PER_CALLER, MAX_STREAMS_PER_CALLER
from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm

LAYERS = [0, 1, 2, 3]
ROW_BYTES = 128 * 4  # hidden size x float32


def long_request(max_tokens: int, capture: bool = False, prompt=(5, 6, 7, 8)) -> engine_pb.GenerateRequest:
    request = engine_pb.GenerateRequest(token_ids=engine_pb.TokenIds(ids=list(prompt)),
                                 sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    if capture:
        for name, tensor_type in (("residual", types_pb.TENSOR_TYPE_RESIDUAL_STREAM), ("mlp", types_pb.TENSOR_TYPE_MLP_OUT)):
            request.extraction_points.add(name=name, tensor_type=tensor_type, layers=LAYERS, stream_to_client=True)
    return request


def no_window_growth() -> list:
    """The attacker's channel reads only what it must: its flow-control windows
    stay at 64 KiB, so what the engine holds for it stays in the engine."""
    return [("grpc.http2.bdp_probe", 0)]


async def test_one_caller_cannot_hold_more_than_its_streams_and_others_are_still_served(attacked_engine):
    dev = DevSecurity.ensure()
    address = attacked_engine.service.address
    async with stack.channel(address) as demo_channel, stack.channel(address, dev.other_client_token) as other_channel:
        demo, other = engine_pb_grpc.EngineServiceStub(demo_channel), engine_pb_grpc.EngineServiceStub(other_channel)
        await other.GetModelInfo(engine_pb.GetModelInfoRequest())
        with stack.vllm_paused(attacked_engine.service):  # the hog's streams stay open
            outcomes = [stack.Outcome() for _ in range(MAX_STREAMS_PER_CALLER)]
            hogs = [asyncio.create_task(stack.generate(demo, long_request(400), outcome=o)) for o in outcomes]
            for outcome, hog in zip(outcomes, hogs):
                await stack.until_started(outcome, hog)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.generate(demo, long_request(4))
            served = stack.Outcome()
            others = asyncio.create_task(stack.generate(other, long_request(4), outcome=served))
            await stack.until_started(served, others)
        assert (await others).reason == "LENGTH"
        assert [(await hog).reason for hog in hogs] == ["LENGTH"] * MAX_STREAMS_PER_CALLER
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.details() == (
        f"caller 'demo' already runs {MAX_STREAMS_PER_CALLER} Generate streams, the most one caller may "
        "(--max-streams-per-caller); retry when one ends")


async def read_all(call) -> tuple[int, engine_pb.GenerateFinished]:
    """(activation bytes received, the finished message) of a Generate call."""
    received, finished = 0, None
    while (response := await call.read()) is not grpc.aio.EOF:
        if response.HasField("activations"):
            received += sum(len(block.rows.data) for block in response.activations.blocks)
        if response.HasField("finished"):
            finished = response.finished
    return received, finished


async def test_a_caller_that_stops_reading_pins_at_most_its_queued_bytes(attacked_engine, capsys):
    dev = DevSecurity.ensure()
    address = attacked_engine.service.address
    hog_tokens, honest_tokens = 480, 100
    hog_bytes = (4 + hog_tokens - 1) * len(LAYERS) * 2 * ROW_BYTES  # per stream: 1.9 MiB, 4 MiB in all
    async with dev.channel(address, options=no_window_growth()) as hog_channel, \
            stack.channel(address, dev.other_client_token) as other_channel:
        hog = engine_pb_grpc.EngineServiceStub(hog_channel)
        generated = stack.scrape(attacked_engine.metrics_port).get("undercurrent_engine_tokens_generated_total", 0)
        calls = [hog.Generate(long_request(hog_tokens, capture=True)) for _ in range(MAX_STREAMS_PER_CALLER)]
        for call in calls:  # started, then read nothing more
            assert (await call.read()).HasField("started")
        await stack.wait_metric(attacked_engine.metrics_port, "undercurrent_engine_tokens_generated_total",
                                lambda value: value >= generated + MAX_STREAMS_PER_CALLER * hog_tokens, timeout=120)
        # Meanwhile another caller's stream gets every row.
        honest = await read_all(engine_pb_grpc.EngineServiceStub(other_channel).Generate(long_request(honest_tokens, True)))
        hogged = [await read_all(call) for call in calls]
    assert honest[1].dropped_records == 0 and honest[0] == (4 + honest_tokens - 1) * len(LAYERS) * 2 * ROW_BYTES
    received = sum(r for r, _ in hogged)
    dropped_rows = sum(f.dropped_records for _, f in hogged)
    with capsys.disabled():
        print(f"\nthe hog's {MAX_STREAMS_PER_CALLER} streams: {received} of "
              f"{MAX_STREAMS_PER_CALLER * hog_bytes} activation bytes reached it, {dropped_rows} rows dropped")
    # What reached the hog: its caller budget, plus per stream what gRPC holds
    # beyond the engine's queue: a 64 KiB flow-control window and the message
    # being sent (a step's rows, 16 KiB at most here).
    slack = MAX_STREAMS_PER_CALLER * (64 + 16) * 1024
    assert received <= MAX_QUEUED_BYTES_PER_CALLER + slack
    assert received + dropped_rows * ROW_BYTES == MAX_STREAMS_PER_CALLER * hog_bytes
    assert dropped_rows * ROW_BYTES >= MAX_STREAMS_PER_CALLER * hog_bytes - MAX_QUEUED_BYTES_PER_CALLER - slack


def prefix_cache_hits(metrics_port: int) -> float:
    return sum(v for k, v in stack.scrape(metrics_port).items() if k.startswith("vllm:prefix_cache_hits_total"))


async def test_callers_never_share_cached_prompt_prefixes(attacked_engine):
    """The timing signal's cause, read from vLLM's own counters: a prompt another
    caller sent hits no cached block; the same caller's repeat does."""
    dev = DevSecurity.ensure()
    address = attacked_engine.service.address
    secret_prefix = list(range(10, 10 + 300))  # more than two KV blocks of any block size here
    request = long_request(1, prompt=secret_prefix)
    port = attacked_engine.metrics_port
    async with stack.channel(address, dev.other_client_token) as victim_channel, stack.channel(address) as spy_channel:
        victim, spy = engine_pb_grpc.EngineServiceStub(victim_channel), engine_pb_grpc.EngineServiceStub(spy_channel)
        await stack.generate(victim, request)
        before_spy = prefix_cache_hits(port)
        await stack.generate(spy, request)
        after_spy = prefix_cache_hits(port)
        await stack.generate(victim, request)
        after_victim = prefix_cache_hits(port)
    assert after_spy == before_spy, "the spy's request hit the victim's cached prefix"
    assert after_victim - after_spy >= 256, "the victim's own repeat should hit its cached prefix"
