"""Capture's checks on what one Generate stream returned: every selected row, once.

The engine is replaced by a scripted stream here (logic around the part); the
real engine is exercised in tests/e2e/test_lifecycle.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.activations import Block, to_batch
from probe_lifecycle.capture import ATTEMPTS, CaptureError, capture_example
from probe_lifecycle.dataset import DatasetSpec
from probe_lifecycle.examples import Example
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client.capture_file import CapturedRequest, LabelledExample
from undercurrent_client.events import event_of

SPEC = DatasetSpec(("residual_stream",), (1,), "generated", "all", 4)
PROMPT = 5


def responses(positions: list[int]) -> list[engine_pb.GenerateResponse]:
    rows = np.arange(len(positions) * 3, dtype=np.float32).reshape(len(positions), 3)
    block = Block("residual_stream", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, rows, ["r"] * len(positions),
                  np.array(positions, np.int64), np.ones(len(positions), bool))
    return [
        engine_pb.GenerateResponse(started=engine_pb.GenerateStarted(request_id="r", prompt_tokens=PROMPT)),
        engine_pb.GenerateResponse(tokens=engine_pb.TokenChunk(token_ids=[1, 2], text="ab")),
        engine_pb.GenerateResponse(activations=to_batch([block])),
        engine_pb.GenerateResponse(tokens=engine_pb.TokenChunk(token_ids=[3, 4], text="cd", first_index=2)),
        engine_pb.GenerateResponse(finished=engine_pb.GenerateFinished(
            finish_reason=types_pb.FINISH_REASON_LENGTH, prompt_tokens=PROMPT, generated_tokens=4)),
    ]


class ScriptedEngine:
    """Answers AsyncEngineClient.generate with one scripted stream per call, in order,
    read into events by the client's own reader."""

    def __init__(self, *streams: list[engine_pb.GenerateResponse]):
        self.streams = list(streams)
        self.requests: list[engine_pb.GenerateRequest] = []

    async def generate(self, request):
        self.requests.append(request)
        for response in self.streams.pop(0):
            yield event_of(response)


EXAMPLE = Example("e1", "river stone", 1, 7)
COMPLETE = [5, 6, 7]  # generated 0..2 of 4: the last sampled token has no row


async def test_a_complete_stream_becomes_one_example_in_position_order():
    engine = ScriptedEngine(responses([7, 5, 6]))
    rows = await capture_example(engine, EXAMPLE, SPEC, ["residual_stream.1"], "in.jsonl")
    assert rows.positions.tolist() == COMPLETE
    assert rows.features["residual_stream.1"][:, 0].tolist() == [3.0, 6.0, 0.0]
    assert rows.request == CapturedRequest("r", "river stone", PROMPT, 4, "LENGTH", "abcd",
                                           LabelledExample("e1", 1, 7))
    request = engine.requests[0]
    assert request.sampling.ignore_eos and request.sampling.temperature == 0
    assert request.extraction_points[0].stream_to_client


async def test_a_missing_row_is_captured_again():
    retried: list[str] = []
    engine = ScriptedEngine(responses([5, 6]), responses(COMPLETE))
    rows = await capture_example(engine, EXAMPLE, SPEC, ["residual_stream.1"], "in.jsonl", retried)
    assert rows.positions.tolist() == COMPLETE
    assert retried == ["in.jsonl:7 (id 'e1'): the engine sent 2 of 3 selected rows "
                       "(missing positions [7], unexpected [])"]


async def test_an_example_never_complete_is_refused_not_written():
    engine = ScriptedEngine(*[responses([5, 6])] * ATTEMPTS)
    with pytest.raises(CaptureError, match=r"in\.jsonl:7 .* 2 of 3 selected rows .* \(in each of 3 attempts\)"):
        await capture_example(engine, EXAMPLE, SPEC, ["residual_stream.1"], "in.jsonl")


async def test_a_position_sent_twice_is_refused():
    engine = ScriptedEngine(responses([5, 6, 6]))
    with pytest.raises(CaptureError, match="a token position arrived twice"):
        await capture_example(engine, EXAMPLE, SPEC, ["residual_stream.1"], "in.jsonl")


async def test_a_stream_without_its_started_message_is_refused():
    engine = ScriptedEngine(responses(COMPLETE)[1:])
    with pytest.raises(CaptureError, match=r"in\.jsonl:7 \(id 'e1'\): the stream ended without a "
                                           "started message"):
        await capture_example(engine, EXAMPLE, SPEC, ["residual_stream.1"], "in.jsonl")
