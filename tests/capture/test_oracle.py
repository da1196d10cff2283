"""Captured activations equal transformers' on the same token sequence (real vLLM)."""

import pytest

from common.capture_spec import ExtractionPoint, Scope, TokenSelector
from tests.capture.oracle import (
    RELATIVE_TOLERANCE,
    check_every_position,
    compare_with_oracle,
    relative_tolerance,
)
from tests.capture.workloads import every_position, prompt
from tools.capture_engines import Request, run_requests
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

async def test_every_tensor_type_on_every_layer_matches_transformers(engine_and_oracle):
    engine, controller, oracle = engine_and_oracle
    requests = every_position("oracle")
    run = await run_requests(engine, controller, requests)
    worst = check_every_position(oracle, run, requests)
    print(f"\noracle {controller.model_info().architecture} TP=1: worst relative L2 error {worst}")


async def test_requests_naming_points_alike_keep_their_own_tensor_types(engine_and_oracle):
    """A point's name is its request's own: two requests in the same steps may both
    call a point "x", on one layer, for different tensor types."""
    engine, controller, oracle = engine_and_oracle
    requests = [
        Request("named-mlp", prompt(7, 4), [ExtractionPoint("x", "mlp_out", (1,))], max_tokens=4),
        Request("named-attn", prompt(7, 5), [ExtractionPoint("x", "attn_out", (1,))], max_tokens=4),
    ]
    run = await run_requests(engine, controller, requests)
    types: dict[str, set[int]] = {}
    for block in run.blocks:
        for request_id in set(block.request_ids):
            types.setdefault(request_id, set()).add(block.tensor_type)
    assert types == {"named-mlp": {types_pb.TENSOR_TYPE_MLP_OUT}, "named-attn": {types_pb.TENSOR_TYPE_ATTN_OUT}}
    compare_with_oracle(oracle, run, requests)


async def test_n_samples_are_captured_per_child(engine_and_oracle):
    engine, controller, oracle = engine_and_oracle
    points = [ExtractionPoint("gen", "residual_stream", (0, 3), TokenSelector(Scope.GENERATED))]
    request = Request("sampled", prompt(6, 9), points, max_tokens=5, n=2)
    run = await run_requests(engine, controller, [request])

    assert sorted(run.tokens) == ["0_sampled", "1_sampled"]
    assert run.tokens["0_sampled"] != run.tokens["1_sampled"]
    records = run.records()
    for child in ("0_sampled", "1_sampled"):
        assert sorted(k[2:] for k in records if k[0] == child) == [
            (layer, position) for layer in (0, 3) for position in range(6, 10)
        ]
    compare_with_oracle(oracle, run, [request])


async def test_prompt_capture_computes_prompts_the_prefix_cache_holds(engine_and_oracle):
    engine, controller, oracle = engine_and_oracle
    shared = prompt(80, 11)  # two full 32-token blocks and a partial one
    generated_only = [ExtractionPoint("gen", "residual_stream", (2,), TokenSelector(Scope.GENERATED))]
    prompt_point = [ExtractionPoint("prompt", "residual_stream", (2,), TokenSelector(Scope.PROMPT))]
    await run_requests(engine, controller, [Request("warm", shared, generated_only, max_tokens=2)])

    computed = Request("recomputed", shared, prompt_point, max_tokens=2)
    run = await run_requests(engine, controller, [computed])
    assert sorted(k[3] for k in run.records()) == list(range(80))
    compare_with_oracle(oracle, run, [computed])
    assert controller.pop_request_errors() == {}

    # An engine that forgets skip_reading_prefix_cache gets a clear per-request
    # error instead of silently missing rows.
    cached = Request("cached", shared, prompt_point, max_tokens=2, compute_prompt=False)
    run = await run_requests(engine, controller, [cached])
    first = min(k[3] for k in run.records())
    assert first > 0 and sorted(k[3] for k in run.records()) == list(range(first, 80))
    assert controller.pop_request_errors() == {
        "cached": f'point "prompt": positions [0, {first}) were served from the prefix cache '
        f"and never computed, so they have no activations; register with "
        f"skip_reading_prefix_cache=True"
    }


def test_tolerance_is_the_stated_one():
    assert RELATIVE_TOLERANCE == relative_tolerance("float32") == 1e-5
    # 16 unit roundoffs (tests/capture/oracle.py says why)
    assert (relative_tolerance("bfloat16"), relative_tolerance("float16")) == (2**-4, 2**-7)
