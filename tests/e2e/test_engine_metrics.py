"""The engine's latency histograms on its real metrics endpoint, after real requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.activations import from_batch
from tools import stack
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

TTFT = "undercurrent_engine_time_to_first_token_seconds"
REQUEST = "undercurrent_engine_request_duration_seconds"
DRAIN = "undercurrent_engine_drain_duration_seconds"
MAX_TOKENS = 12


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def test_latency_histograms_count_each_request_once_within_its_client_time(engine, engine_metrics_port):
    before = await asyncio.to_thread(stack.scrape, engine_metrics_port)
    request = engine_pb.GenerateRequest(
        text="metrics for one request",
        sampling=engine_pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
        extraction_points=[types_pb.ExtractionPoint(
            name="rows", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[1],
            tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_GENERATED), stream_to_client=True)],
    )
    started = time.monotonic()
    outcome = await stack.generate(engine, request)
    client_seconds = time.monotonic() - started
    assert outcome.reason == "LENGTH" and len(outcome.tokens) == MAX_TOKENS
    assert outcome.batches, "the request captured rows, so drains delivered some"
    after = await asyncio.to_thread(stack.scrape, engine_metrics_port)

    assert delta(before, after, f"{TTFT}_count") == 1
    assert delta(before, after, f'{REQUEST}_count{{reason="LENGTH"}}') == 1
    ttft = delta(before, after, f"{TTFT}_sum")
    whole = delta(before, after, f'{REQUEST}_sum{{reason="LENGTH"}}')
    # The engine sees the request inside the client's view of it, and its first
    # token before its end.
    assert 0 < ttft < whole <= client_seconds
    # Every observation falls in some bucket: the +Inf bucket moved with the count.
    assert delta(before, after, f'{REQUEST}_bucket{{le="+Inf",reason="LENGTH"}}') == 1
    # Drains that delivered rows: at least one for the rows streamed back, and
    # (with nothing else running) no more than one per row the request captured.
    drains = delta(before, after, f"{DRAIN}_count")
    rows = sum(block.num_rows for batch in outcome.batches for block in from_batch(batch))
    assert 1 <= drains <= rows
    assert 0 < delta(before, after, f"{DRAIN}_sum") <= client_seconds
