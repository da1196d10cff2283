"""The engine's request limits and its per-request client stream, without vLLM or gRPC."""

import asyncio
import threading
import time

import numpy as np
import pytest

from common.activations import Block, from_batch
from common.errors import InvalidArgument, ResourceExhausted
from engine_service.request import validation as reqs
from engine_service.request.client_stream import ClientStream
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

MODEL = reqs.ModelLimits(vocab_size=512, max_model_len=64)
LIMITS = reqs.RequestLimits(max_streams=2, max_extraction_points=3, max_message_bytes=8 * 1024 * 1024)


def test_unknown_enum_values_are_refused_naming_the_field():
    bad = engine_pb.GenerateRequest(text="hi", probes=[types_pb.ProbeBinding(probe="p", failure_policy=9)])
    with pytest.raises(InvalidArgument, match=r"^probes\[0\]\.failure_policy: 9 is not a FailurePolicy$"):
        reqs.check_request(bad, 0, LIMITS, MODEL)
    bad = engine_pb.GenerateRequest(text="hi", probes=[types_pb.ProbeBinding(probe="p", action=4)])
    with pytest.raises(InvalidArgument, match=r"^probes\[0\]\.action: 4 is not a ProbeAction$"):
        reqs.check_request(bad, 0, LIMITS, MODEL)
    bad = engine_pb.GenerateRequest(text="hi", extraction_points=[types_pb.ExtractionPoint(name="a", tensor_type=6)])
    with pytest.raises(InvalidArgument, match=r"^extraction_points\[0\]\.tensor_type: 6 is not a TensorType$"):
        reqs.check_request(bad, 0, LIMITS, MODEL)
    bad = engine_pb.GenerateRequest(text="hi", extraction_points=[
        types_pb.ExtractionPoint(name="a", tensor_type=1, tokens=types_pb.TokenSelector(scope=5))])
    with pytest.raises(InvalidArgument, match=r"^extraction_points\[0\]\.tokens\.scope: 5 is not a TokenSelector.Scope$"):
        reqs.check_request(bad, 0, LIMITS, MODEL)
    reqs.check_request(engine_pb.GenerateRequest(text="hi", probes=[types_pb.ProbeBinding(probe="p", failure_policy=2)]),
                       0, LIMITS, MODEL)


def test_streams_and_extraction_points_past_their_limit_are_resource_exhausted():
    reqs.check_request(engine_pb.GenerateRequest(text="hi"), 1, LIMITS, MODEL)
    with pytest.raises(ResourceExhausted, match="already runs 2 Generate streams, its --max-streams"):
        reqs.check_request(engine_pb.GenerateRequest(text="hi"), 2, LIMITS, MODEL)
    points = [types_pb.ExtractionPoint(name=f"p{i}", tensor_type=1, layers=[0]) for i in range(4)]
    reqs.check_request(engine_pb.GenerateRequest(text="hi", extraction_points=points[:3]), 0, LIMITS, MODEL)
    with pytest.raises(ResourceExhausted, match=r"extraction_points: 4 points, at most 3 per request"):
        reqs.check_request(engine_pb.GenerateRequest(text="hi", extraction_points=points), 0, LIMITS, MODEL)


def test_oversized_prompt_text_is_refused_by_bytes_before_tokenizing():
    allowed = reqs.PROMPT_BYTES_PER_TOKEN * MODEL.max_model_len  # the default: derived from max_model_len
    reqs.check_request(engine_pb.GenerateRequest(text="a" * allowed), 0, LIMITS, MODEL)
    with pytest.raises(InvalidArgument, match=rf"^prompt.text: over {allowed} bytes \(--max-prompt-bytes\)"):
        reqs.check_request(engine_pb.GenerateRequest(text="a" * (allowed + 1)), 0, LIMITS, MODEL)
    # Bytes, not characters: 3-byte characters reach the limit at a third of the length.
    with pytest.raises(InvalidArgument, match="prompt.text: over"):
        reqs.check_request(engine_pb.GenerateRequest(text="\u20ac" * (allowed // 3 + 1)), 0, LIMITS, MODEL)
    explicit = reqs.RequestLimits(max_prompt_bytes=10)
    with pytest.raises(InvalidArgument, match="over 10 bytes"):
        reqs.check_request(engine_pb.GenerateRequest(text="a" * 11), 0, explicit, MODEL)


def test_client_message_size_defaults_to_4_mib_and_is_capped_at_the_server_limit():
    assert reqs.client_message_bytes(engine_pb.GenerateRequest(), LIMITS) == 4 * 1024 * 1024
    assert reqs.client_message_bytes(engine_pb.GenerateRequest(max_activation_message_bytes=100_000), LIMITS) == 100_000
    assert reqs.client_message_bytes(engine_pb.GenerateRequest(max_activation_message_bytes=2**31), LIMITS) == 8 * 1024 * 1024
    with pytest.raises(InvalidArgument, match="max_activation_message_bytes: 1000 is under the minimum 65536"):
        reqs.client_message_bytes(engine_pb.GenerateRequest(max_activation_message_bytes=1000), LIMITS)


async def test_text_is_tokenized_off_the_event_loop():
    loop_thread = threading.get_ident()
    seen = []

    def slow_tokenize(text):
        seen.append(threading.get_ident())
        time.sleep(0.3)
        return [1, 2]

    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    ids = await reqs.prompt_ids_off_loop(engine_pb.GenerateRequest(text="hello"), slow_tokenize, MODEL)
    task.cancel()
    assert ids == [1, 2] and seen and seen[0] != loop_thread
    assert ticks >= 10  # the loop kept running while the tokenizer worked


def step_blocks(request_id: str, rows: int, hidden: int, layers=(0, 1)) -> list[Block]:
    return [Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer,
                  np.arange(rows * hidden, dtype=np.float32).reshape(rows, hidden) + layer,
                  [request_id] * rows, np.arange(rows, dtype=np.int64), np.zeros(rows, bool))
            for layer in layers]


async def test_activation_messages_are_split_to_the_clients_size_and_keep_every_row_in_order():
    limit = 64 * 1024
    stream = ClientStream(budget_bytes=10**9, max_activation_message_bytes=limit)
    blocks = step_blocks("r", rows=100, hidden=256)  # 2 x 100 KB of rows
    stream.put_activations(blocks)
    messages = [await stream.get() for _ in range(stream.qsize())]
    assert len(messages) >= 4
    assert all(m.ByteSize() <= limit for m in messages)
    got = [b for m in messages for b in from_batch(m.activations)]
    keys = [(b.layer, int(p)) for b in got for p in b.token_positions]
    assert keys == [(layer, p) for layer in (0, 1) for p in range(100)]
    rows = np.concatenate([b.rows for b in got])
    np.testing.assert_array_equal(rows, np.concatenate([b.rows for b in blocks]))
    assert stream.dropped_records == 0 and stream.queued_bytes == 0


async def test_the_queue_is_bounded_in_bytes_and_never_drops_tokens_or_finished():
    drops = []
    stream = ClientStream(budget_bytes=50_000, max_activation_message_bytes=4 * 1024 * 1024,
                          on_drop=drops.append)
    token = engine_pb.GenerateResponse(tokens=engine_pb.TokenChunk(token_ids=[1], text="a"))
    assert stream.put_nowait(token)
    stream.put_activations(step_blocks("r", rows=10, hidden=256, layers=(0,)))  # ~10 KB: fits
    stream.put_activations(step_blocks("r", rows=40, hidden=256, layers=(0,)))  # ~40 KB: over budget
    scores = engine_pb.GenerateResponse(probe_event=engine_pb.ProbeEvent(scores=types_pb.ProbeScores(
        request_id="r", token_positions=list(range(20000)), scores=[0.5] * 20000)))
    assert not stream.put_nowait(scores)  # over budget: dropped, its 20000 scores counted
    for _ in range(100):  # tokens past the budget are still queued
        assert stream.put_nowait(token)
    assert stream.put_nowait(engine_pb.GenerateResponse(finished=engine_pb.GenerateFinished()))
    assert stream.dropped_records == 40 + 20000 and drops == [40, 20000]
    kinds = [(await stream.get()).WhichOneof("event") for _ in range(stream.qsize())]
    assert kinds == ["tokens", "activations"] + ["tokens"] * 100 + ["finished"]
    assert stream.queued_bytes == 0
    # Once the client read, activations fit again.
    stream.put_activations(step_blocks("r", rows=40, hidden=256, layers=(0,)))
    assert stream.qsize() == 1 and stream.dropped_records == 20040


async def test_a_row_larger_than_the_clients_message_is_dropped_and_counted():
    stream = ClientStream(budget_bytes=10**9, max_activation_message_bytes=64 * 1024)
    stream.put_activations(step_blocks("r", rows=3, hidden=32 * 1024, layers=(0,)))  # 128 KB per row
    assert stream.qsize() == 0 and stream.dropped_records == 3


async def test_a_slow_client_loses_counted_activations_never_tokens_in_the_runtime():
    """The runtime with a fake vLLM (tests/engine/fakes.py): a client that reads
    nothing while its request runs overflows a 4 KiB queue."""
    import vllm.sampling_params  # noqa: F401  (the runtime imports it per request)

    from engine_service.service.runtime import EngineRuntime, EngineSettings
    from tests.engine.fakes import FakeCapture, FakeEngine
    from tests.engine_link.helpers import until

    capture = FakeCapture(hidden=64)  # 256 B rows
    llm = FakeEngine(capture)
    runtime = EngineRuntime(llm, capture, settings=EngineSettings(
        limits=reqs.RequestLimits(client_queue_bytes=4096)))
    await runtime.start()
    stepper = asyncio.create_task(llm.run_steps(0.002))
    try:
        message = engine_pb.GenerateRequest(
            request_id="slow", token_ids=engine_pb.TokenIds(ids=[1, 2, 3, 4]), sampling=engine_pb.SamplingParams(max_tokens=30),
            extraction_points=[types_pb.ExtractionPoint(name="resid", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM,
                                                  layers=[0, 1], stream_to_client=True)])
        stream = runtime.generate(message)
        assert (await anext(stream)).HasField("started")
        finished_total = runtime.metrics.registry.get_sample_value
        await until(lambda: finished_total("undercurrent_engine_requests_finished_total", {"reason": "LENGTH"}) == 1)
        responses = [response async for response in stream]
    finally:
        stepper.cancel()
        await runtime.close()
    tokens = [t for r in responses if r.HasField("tokens") for t in r.tokens.token_ids]
    rows = sum(len(b.token_positions) for r in responses if r.HasField("activations") for b in r.activations.blocks)
    finished = responses[-1].finished
    assert len(tokens) == 30 and finished.generated_tokens == 30
    # 4 prompt positions and 29 fed-back tokens, on 2 layers: each row arrived or was counted.
    assert 0 < finished.dropped_records and rows + finished.dropped_records == (4 + 29) * 2
    assert runtime.metrics.registry.get_sample_value(
        "undercurrent_engine_dropped_records_total", {"queue": "client_queue"}) == finished.dropped_records
    assert sum(r.ByteSize() for r in responses if r.HasField("activations")) <= 4096
