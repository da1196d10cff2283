"""The Engine API as a client sees it: bad input, aborts, cancellation, discovery."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from common.activations import from_batch
from tests.e2e.conftest import MAX_MODEL_LEN
from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm


def simple(rid: str = "", max_tokens: int = 4, **fields) -> engine_pb.GenerateRequest:
    fields.setdefault("text", "hello there")
    return engine_pb.GenerateRequest(
        request_id=rid, sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        **fields,
    )


async def expect_error(engine, message: engine_pb.GenerateRequest, code, *fragments):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stack.generate(engine, message)
    assert failure.value.code() == code, failure.value.details()
    for fragment in fragments:
        assert fragment in failure.value.details()


async def test_model_info_reports_topology(engine):
    info = (await engine.GetModelInfo(engine_pb.GetModelInfoRequest())).model
    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.hidden_size, info.dtype) == (4, 128, "float32")
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (1, 1)
    assert [(r.start_layer, r.end_layer, r.has_final_norm) for r in info.ranks] == [(0, 4, True)]
    assert set(info.tensor_types) == {types_pb.TENSOR_TYPE_RESIDUAL_STREAM, types_pb.TENSOR_TYPE_ATTN_OUT, types_pb.TENSOR_TYPE_MLP_OUT, types_pb.TENSOR_TYPE_FINAL_NORM}
    assert info.vocab_size == 512 and info.max_model_len == MAX_MODEL_LEN


async def test_bad_requests_get_precise_errors_and_the_engine_keeps_serving(engine):
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    await expect_error(engine, simple(text=""), invalid, "prompt.text: is empty")
    await expect_error(engine, engine_pb.GenerateRequest(), invalid, "prompt: set either text or token_ids")
    await expect_error(engine, simple(text=None, token_ids=engine_pb.TokenIds(ids=[1, 9999])), invalid,
                       "prompt.token_ids", "[9999]", "outside the vocabulary")
    await expect_error(engine, simple(max_tokens=1100), invalid, "sampling.max_tokens: 1100",
                       f"max_model_len {MAX_MODEL_LEN}")
    await expect_error(engine, simple(text="x " * 1100), invalid, f"max_model_len {MAX_MODEL_LEN}")
    unowned = simple(extraction_points=[types_pb.ExtractionPoint(
        name="deep", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[9])])
    await expect_error(engine, unowned, invalid, 'extraction_points[0] "deep"', "layers[0]=9")
    bad_selector = simple(extraction_points=[types_pb.ExtractionPoint(
        name="sel", tensor_type=types_pb.TENSOR_TYPE_MLP_OUT, layers=[1],
        tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_GENERATED, indexes=[-1]))])
    await expect_error(engine, bad_selector, invalid, 'extraction_points[0] "sel"')
    unknown_type = simple(extraction_points=[types_pb.ExtractionPoint(name="t", tensor_type=99, layers=[1])])
    await expect_error(engine, unknown_type, invalid, "extraction_points[0].tensor_type: 99 is not a TensorType")
    unknown_policy = simple(probes=[types_pb.ProbeBinding(probe="p", failure_policy=9)])
    await expect_error(engine, unknown_policy, invalid, "probes[0].failure_policy: 9 is not a FailurePolicy")
    unknown_probe = simple()
    unknown_probe.probes.add(probe="no_such_probe")
    await expect_error(engine, unknown_probe, grpc.StatusCode.NOT_FOUND, "probes[0].probe",
                       "'no_such_probe'")
    outcome = await stack.generate(engine, simple("still-fine"))
    assert outcome.reason == "LENGTH" and len(outcome.tokens) == 4


async def test_duplicate_running_request_id_is_refused(engine_service, engine):
    running = stack.Outcome()
    with stack.vllm_paused(engine_service):  # so the first request is still running when its duplicate comes
        first = asyncio.create_task(stack.generate(engine, simple("twice", max_tokens=400, text="a b c"),
                                                   outcome=running))
        await stack.until_started(running, first)
        await expect_error(engine, simple("twice"), grpc.StatusCode.ALREADY_EXISTS, "'twice' is already running")
        assert (await engine.Abort(engine_pb.AbortRequest(request_id="twice"))).found
    outcome = await first
    assert outcome.reason == "CLIENT_ABORT" and len(outcome.tokens) < 400, outcome.finished
    # The id is free again.
    assert (await stack.generate(engine, simple("twice"))).reason == "LENGTH"


async def test_abort_of_unknown_request_reports_not_found(engine):
    assert not (await engine.Abort(engine_pb.AbortRequest(request_id="never-started"))).found


async def test_cancelled_stream_aborts_the_request_in_vllm(engine_service, engine, engine_metrics_port):
    client_aborts = 'undercurrent_engine_requests_finished_total{reason="CLIENT_ABORT"}'
    before = stack.scrape(engine_metrics_port).get(client_aborts, 0.0)
    with stack.vllm_paused(engine_service):  # so the stream is cancelled while the request runs
        call = engine.Generate(simple("cancel-me", max_tokens=400))
        async for response in call:
            if response.WhichOneof("event") == "started":
                break
        call.cancel()
    # It ends as a client abort (read from the metrics: an Abort would end it too) ...
    assert await stack.wait_metric(engine_metrics_port, client_aborts, lambda count: count > before,
                                   timeout=10) == before + 1
    # ... and its id is free again once its stream has closed.
    for _ in range(50):
        if not (await engine.Abort(engine_pb.AbortRequest(request_id="cancel-me"))).found:
            break
        await asyncio.sleep(0.1)
    outcome = await stack.generate(engine, simple("cancel-me"))
    assert outcome.reason == "LENGTH"


async def test_capture_streamed_to_the_client_without_any_router(engine):
    point = types_pb.ExtractionPoint(
        name="last_prompt", tensor_type=types_pb.TENSOR_TYPE_MLP_OUT, layers=[0, 2],
        tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_PROMPT, indexes=[-1]), stream_to_client=True)
    outcome = await stack.generate(engine, simple("capture", max_tokens=3, extraction_points=[point]))
    blocks = [b for batch in outcome.batches for b in from_batch(batch)]
    last = outcome.finished.prompt_tokens - 1
    assert [(b.point, b.layer, list(b.token_positions), list(b.is_generated)) for b in blocks] == [
        ("last_prompt", 0, [last], [False]), ("last_prompt", 2, [last], [False])]
    assert all(b.rows.shape == (1, 128) and np.isfinite(b.rows).all() for b in blocks)


async def test_reflection_and_health_list_every_service(engine_service, start_router):
    router = await start_router(1)
    expected = {
        engine_service.address: {"undercurrent.v1.EngineService", "grpc.health.v1.Health"},
        router.address: {"undercurrent.v1.ProbeRouterService", "undercurrent.v1.ProbeAdminService",
                         "grpc.health.v1.Health"},
    }
    for address, services in expected.items():
        with grpc.secure_channel(address, DevSecurity.ensure().channel_credentials()) as channel:
            listed = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert services <= listed, (address, listed)
    # The engine is SERVING while a router session is up (it reconnects with
    # backoff), and NOT_SERVING once none is.
    await engine_service.wait_health(want_serving=True, timeout=30)
    router.kill()
    await engine_service.wait_health(want_serving=False, timeout=30)
