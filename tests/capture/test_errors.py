"""Bad extraction points are refused at registration, naming the point, and the
engine keeps serving (real vLLM)."""

import asyncio

import pytest

from common.capture_spec import ExtractionPoint, Scope, TokenSelector, parse_points
from common.errors import InvalidArgument
from tests.capture.workloads import prompt
from tools.capture_engines import Request, run_requests
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

GOOD = ExtractionPoint("good", "residual_stream", (1,))


async def refusal(controller, request_id, points, prompt_tokens=5) -> str:
    with pytest.raises(InvalidArgument) as info:
        await controller.register(request_id, points, prompt_tokens)
    return str(info.value)


async def test_bad_points_are_refused_and_the_engine_keeps_serving(llama_engine):
    engine, controller = llama_engine
    serving = asyncio.create_task(
        run_requests(engine, controller, [Request("bystander", prompt(20, 4), [GOOD], max_tokens=8)])
    )

    assert await refusal(controller, "e1", [GOOD, ExtractionPoint("late", "mlp_out", (9,))]) == (
        'extraction_points[1] "late": layers[0]=9 is out of range [0, 4)'
    )
    # Layer 4 is num_layers: out of range for layer-wise types (final_norm carries it).
    assert await refusal(controller, "e2", [ExtractionPoint("edge", "attn_out", (4,))]) == (
        'extraction_points[0] "edge": layers[0]=4 is out of range [0, 4)'
    )
    assert await refusal(controller, "e3", [ExtractionPoint("kv", "kv_cache", (0,))]) == (
        "extraction_points[0] \"kv\": tensor_type 'kv_cache' is not one of "
        "['residual_stream', 'attn_out', 'mlp_out', 'final_norm']"
    )
    tail = ExtractionPoint("tail", "residual_stream", (0,), TokenSelector(Scope.GENERATED, (-1,)))
    assert (await refusal(controller, "e4", [tail])).startswith(
        'extraction_points[0] "tail": tokens.indexes[0]=-1 is negative, which only scope PROMPT allows'
    )
    beyond = ExtractionPoint("beyond", "residual_stream", (0,), TokenSelector(Scope.PROMPT, (-9,)))
    assert await refusal(controller, "e5", [beyond]) == (
        'extraction_points[0] "beyond": tokens.indexes[0]=-9 is outside the prompt of 5 tokens'
    )
    with pytest.raises(InvalidArgument, match=r'extraction_points\[0\] "u": tensor_type TENSOR_TYPE_UNSPECIFIED'):
        parse_points([types_pb.ExtractionPoint(name="u", layers=[0])], controller.model_info().num_layers)

    run = await serving
    assert len(run.tokens["bystander"]) == 8
    assert sorted(k[3] for k in run.records()) == list(range(20 + 8 - 1))
    # A refused registration left nothing behind: the same ids register cleanly now.
    after = await run_requests(engine, controller, [Request("e1", prompt(5, 5), [GOOD], max_tokens=2)])
    assert sorted(k[3] for k in after.records()) == [0, 1, 2, 3, 4, 5]


async def test_nothing_registered_drains_without_a_round_trip(llama_engine):
    engine, controller = llama_engine
    assert await controller.drain() == []
    # No collective_rpc happened: a closed engine would have raised.
    saved, controller.engine = controller.engine, None
    try:
        assert await controller.drain() == []
    finally:
        controller.engine = saved


async def test_rows_are_pushed_with_no_drain_round_trip_and_an_ending_request_arrives_whole(llama_engine):
    """Workers push each step's rows; the engine core serves no drain RPC, and the
    drain after unregister waits for the request's last push (the barrier)."""
    engine, controller = llama_engine
    calls = []
    real = engine.collective_rpc

    async def counting(method, *args, **kwargs):
        calls.append(method)
        return await real(method, *args, **kwargs)

    engine.collective_rpc = counting
    try:
        run = await run_requests(engine, controller, [Request("pushed", prompt(6, 1), [GOOD], max_tokens=5)])
    finally:
        del engine.collective_rpc
    assert calls == ["undercurrent_register", "undercurrent_unregister"]
    assert sorted(k[3] for k in run.records()) == list(range(6 + 5 - 1))
    # Nothing of the request arrives after its ending drain.
    assert await controller.drain() == []


async def test_the_rpc_drain_still_delivers_every_row_when_workers_do_not_push(llama_engine):
    """The path for workers on another host: no push, one collective_rpc per drain."""
    engine, controller = llama_engine
    calls = []
    real = engine.collective_rpc

    async def counting(method, *args, **kwargs):
        calls.append(method)
        return await real(method, *args, **kwargs)

    await controller.use_push(False)
    engine.collective_rpc = counting
    try:
        run = await run_requests(engine, controller, [Request("drained", prompt(6, 2), [GOOD], max_tokens=5)])
    finally:
        del engine.collective_rpc
        await controller.use_push(True)
    assert "undercurrent_drain" in calls
    assert sorted(k[3] for k in run.records()) == list(range(6 + 5 - 1))


def test_a_planned_step_whose_sites_never_ran_is_an_error_not_an_empty_capture():
    """What a model compiled without its sites (a foreign compile cache) would do;
    the state's step logic alone, as no real engine can be built that way here."""
    from engine_service.capture.worker.staging import StepStaging
    from engine_service.capture.worker.extension import _CaptureState

    def planned() -> StepStaging:
        return StepStaging({("residual_stream", 1): []}, "cpu")

    state = _CaptureState.__new__(_CaptureState)
    state.errors, state.pusher = [], None
    for staging, sites_ran in ((None, False), (StepStaging({}, "cpu"), False), (planned(), True)):
        state.staging, state.sites_ran = staging, sites_ran
        state._after_step(None, (), None)
        assert state.errors == []
    state.staging, state.sites_ran = planned(), False
    state._after_step(None, (), None)
    assert state.errors == [
        "the model's capture sites did not run in this step's forward pass: it was compiled "
        "without them; restart the engine with --enforce-eager, or after clearing vLLM's compile "
        "cache (torch_compile_cache under $VLLM_CACHE_ROOT, ~/.cache/vllm by default)"
    ]
