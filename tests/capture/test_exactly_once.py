"""Exactly once under load: many concurrent requests, mixed prompt lengths, and a
KV cache so small that vLLM preempts requests and recomputes their positions."""

import pytest

from common.capture_spec import ExtractionPoint
from tests.capture.oracle import compare_with_oracle
from tests.capture.workloads import prompt
from tools.capture_engines import Request, capture_engine, run_requests

pytestmark = pytest.mark.vllm

POINTS = [
    ExtractionPoint("stream", "residual_stream", (1, 3)),
    ExtractionPoint("norm", "final_norm"),
]


@pytest.fixture(scope="module")
async def preempting_engine(tiny_llama_path):
    """Eight 32-token blocks for twelve requests that need up to three each."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    preemptions: list[int] = []

    class PreemptionCounter(StatLoggerBase):
        def __init__(self, vllm_config, engine_index=0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if iteration_stats is not None:
                preemptions.append(iteration_stats.num_preempted_reqs)

        def log_engine_initialized(self):
            pass

    async with capture_engine(
        tiny_llama_path,
        stat_loggers=[PreemptionCounter],
        disable_log_stats=False,
        block_size=32,
        num_gpu_blocks_override=8,
        max_model_len=96,
        max_num_batched_tokens=96,
    ) as (engine, controller):
        yield engine, controller, preemptions


async def test_every_key_arrives_once_despite_preemption(preempting_engine, llama_oracle):
    engine, controller, preemptions = preempting_engine
    requests = [
        Request(f"load-{i}", prompt(length, i), POINTS, max_tokens=40)
        for i, length in enumerate([3, 30, 9, 41, 17, 5, 50, 24, 12, 36, 7, 45])
    ]
    run = await run_requests(engine, controller, requests)

    assert sum(preemptions) > 0, "the small KV cache did not make vLLM preempt"
    assert controller.recomputed_rows_discarded > 0, "no recomputed position reached the drain"
    records = run.records()  # asserts no key arrives twice
    for request in requests:
        positions = list(range(len(request.prompt_token_ids) + request.max_tokens - 1))
        for point, layer in (("stream", 1), ("stream", 3), ("norm", 4)):
            got = sorted(k[3] for k in records if k[:3] == (request.request_id, point, layer))
            assert got == positions, f"{request.request_id} {point}@{layer}"
    worst = compare_with_oracle(llama_oracle, run, requests)
    print(
        f"\nexactly once: {sum(preemptions)} preemptions, {controller.recomputed_rows_discarded} "
        f"recomputed rows discarded, {len(records)} records, worst error {worst}"
    )
