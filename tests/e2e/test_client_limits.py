"""Client limits on a real engine: a huge prompt is refused without stalling other
streams (by the client port's receive limit, or past --max-prompt-bytes by its
size), and activations come in messages no larger than the client asked for."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.activations import from_batch
from tests.e2e.conftest import MAX_MODEL_LEN
from tools import stack
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

HUGE_PROMPT_BYTES = 8 * 1024 * 1024
# Before prompts were size-checked and tokenized off the event loop, 8 MB of text
# held the loop 10-21 s on a quiet host (longer on a loaded one: tokenizing is CPU
# work). Over plaintext a shared 2-core machine showed gaps of 0.35-0.5 s; over
# TLS, with the machine loaded, up to 2.3 s, and 5.35 s once with benchmarks
# running beside the suite (receiving and parsing 24 MB of requests on both
# ends), so the bound sits below the broken behaviour, not at it.
MAX_GAP_S = 8.0


async def test_a_huge_prompt_is_refused_by_size_while_another_stream_keeps_flowing(engine):
    running = engine_pb.GenerateRequest(
        request_id="steady", token_ids=engine_pb.TokenIds(ids=list(range(3, 40))),
        sampling=engine_pb.SamplingParams(max_tokens=600, temperature=0, ignore_eos=True))
    arrivals: list[float] = []
    first_token = asyncio.Event()

    async def consume():
        async for response in engine.Generate(running, timeout=300):
            if response.WhichOneof("event") == "tokens":
                arrivals.append(time.monotonic())
                first_token.set()
            elif response.WhichOneof("event") == "finished":
                return response.finished

    steady = asyncio.create_task(consume())
    await asyncio.wait_for(first_token.wait(), 120)

    async def huge(i: int) -> tuple[float, grpc.aio.AioRpcError]:
        request = engine_pb.GenerateRequest(text="word " * (HUGE_PROMPT_BYTES // 5),
                                     sampling=engine_pb.SamplingParams(max_tokens=1))
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in engine.Generate(request, timeout=120):
                pass
        return time.monotonic() - started, refused.value

    window_start = time.monotonic()
    results = await asyncio.gather(*(huge(i) for i in range(3)))
    window_end = time.monotonic()
    finished = await steady
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= window_start and a <= window_end]
    gap = max(during, default=0.0)
    print(f"\n3 x {HUGE_PROMPT_BYTES} B prompts refused in {[round(s, 3) for s, _ in results]} s; "
          f"the other stream's longest gap meanwhile: {gap * 1000:.0f} ms over {len(during)} chunks")
    # The client port receives no request larger than a prompt that can fit plus 1 MiB.
    for seconds, err in results:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "Received message larger than max" in err.details()
    # A prompt within that but over --max-prompt-bytes is refused by its size, unparsed.
    over = engine_pb.GenerateRequest(text="x" * (32 * MAX_MODEL_LEN + 1), sampling=engine_pb.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in engine.Generate(over, timeout=120):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"prompt.text: over {32 * MAX_MODEL_LEN} bytes (--max-prompt-bytes)")
    assert finished.finish_reason == types_pb.FINISH_REASON_LENGTH and finished.generated_tokens == 600
    assert during, "the other stream sent nothing while the huge prompts were handled"
    assert gap < MAX_GAP_S


async def test_client_activations_are_split_to_the_size_the_client_asked_for(engine):
    prompt = list(range(3, 503))
    point = types_pb.ExtractionPoint(name="all", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[0, 1, 2, 3],
                               tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_PROMPT),
                               stream_to_client=True)
    limit = 64 * 1024
    request = engine_pb.GenerateRequest(
        request_id="split", token_ids=engine_pb.TokenIds(ids=prompt), extraction_points=[point],
        sampling=engine_pb.SamplingParams(max_tokens=1, temperature=0), max_activation_message_bytes=limit)
    # 500 prompt rows x 4 layers x 128 floats: ~1 MB of rows, 16 or more messages of 64 KiB.
    outcome = await stack.generate(engine, request)
    sizes = [engine_pb.GenerateResponse(activations=batch).ByteSize() for batch in outcome.batches]
    assert len(sizes) >= 16 and max(sizes) <= limit, sizes
    keys = sorted((b.layer, int(p)) for batch in outcome.batches for b in from_batch(batch)
                  for p in b.token_positions)
    assert keys == [(layer, p) for layer in range(4) for p in range(500)]
    assert outcome.finished.dropped_records == 0
