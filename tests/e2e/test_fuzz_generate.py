"""Fuzzing Generate (and Abort, GetModelInfo) on a real engine: random messages
built from the descriptors, random, truncated, padded and oversized bytes.

Every answer is a proper status (never UNKNOWN or INTERNAL), a stream that
starts ends with `finished`, the engine keeps serving, and no request is left
running (started minus finished, from the engine's metrics).
"""

from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.grpc_server import MAX_MESSAGE_BYTES, channel_options
from tests.message_strategies import messages, wire_bytes
from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
          grpc.StatusCode.ALREADY_EXISTS}
CASES = {"messages": 0, "bytes": 0, "other_rpcs": 0}
# Tiny generations keep a case to tens of milliseconds; occasionally a huge value.
SMALL = {
    "undercurrent.v1.SamplingParams.max_tokens": st.one_of(st.integers(1, 3), st.just(2**32 - 1)),
    "undercurrent.v1.TokenIds.ids": st.one_of(st.integers(0, 511), st.integers(-(2**31), 2**31 - 1)),
    "undercurrent.v1.GenerateRequest.text": st.text(max_size=40),
}


@pytest.fixture(scope="module")
def engine_channel(engine_service, engine_metrics_port):
    channel = grpc.secure_channel(engine_service.address, DevSecurity.ensure().channel_credentials(),
                                  options=channel_options(2 * MAX_MESSAGE_BYTES))
    assert stack.running_requests(engine_metrics_port) == 0
    yield channel
    channel.close()
    print(f"\nGenerate fuzz cases run: {CASES} (total {sum(CASES.values())})")


def generate_call(channel):
    return channel.unary_stream("/undercurrent.v1.EngineService/Generate",
                                response_deserializer=engine_pb.GenerateResponse.FromString)


def run_generate(channel, payload: bytes) -> None:
    """One Generate call with raw request bytes; checks the status and the stream's shape."""
    kinds = []
    try:
        for response in generate_call(channel)(payload, timeout=60):
            kinds.append(response.WhichOneof("event"))
    except grpc.RpcError as err:
        assert err.code() in PROPER, (err.code(), err.details())
        assert not kinds or err.code() != grpc.StatusCode.OK
        return
    assert kinds[0] == "started" and kinds[-1] == "finished" and kinds.count("finished") == 1, kinds


def settle(metrics_port: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (running := stack.running_requests(metrics_port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=messages(engine_pb.GenerateRequest, overrides=SMALL))
def test_random_generate_requests(engine_channel, engine_metrics_port, request):
    CASES["messages"] += 1
    run_generate(engine_channel, request.SerializeToString())
    assert settle(engine_metrics_port) == 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=wire_bytes(engine_pb.GenerateRequest, overrides=SMALL))
def test_random_truncated_and_padded_generate_bytes(engine_channel, engine_metrics_port, payload):
    CASES["bytes"] += 1
    run_generate(engine_channel, payload)
    assert settle(engine_metrics_port) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["Abort", "GetModelInfo"]), data=st.data())
def test_random_abort_and_model_info_calls(engine_channel, method, data):
    CASES["other_rpcs"] += 1
    request_class = engine_pb.AbortRequest if method == "Abort" else engine_pb.GetModelInfoRequest
    payload = data.draw(wire_bytes(request_class))
    call = engine_channel.unary_unary(f"/undercurrent.v1.EngineService/{method}")
    try:
        call(payload, timeout=30)
    except grpc.RpcError as err:
        assert err.code() in PROPER, (err.code(), err.details())


def test_oversized_and_duplicate_requests_then_the_engine_still_serves(engine_channel, engine_metrics_port):
    huge = engine_pb.GenerateRequest(token_ids=engine_pb.TokenIds(ids=[5] * (MAX_MESSAGE_BYTES // 1 + 16)))
    with pytest.raises(grpc.RpcError) as oversized:
        list(generate_call(engine_channel)(huge.SerializeToString(), timeout=120))
    assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert settle(engine_metrics_port) == 0
    request = engine_pb.GenerateRequest(request_id="fuzz-still-serving", text="hello there",
                                 sampling=engine_pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    responses = list(generate_call(engine_channel)(request.SerializeToString(), timeout=60))
    assert responses[-1].finished.finish_reason == types_pb.FINISH_REASON_LENGTH
    assert responses[-1].finished.generated_tokens == 3
    assert settle(engine_metrics_port) == 0
