"""The end-to-end abort under tensor and pipeline parallelism (real worker
processes): the probe fires at the same token, and only there."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e import probes, stack
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.vllm, pytest.mark.multiworker]

PROMPTS = ["The quick brown fox", "Hello, world! How are"]
MAX_TOKENS = 120
TRIGGER_MIN_INDEX = 3
# Tokens generated after the triggering one before the abort lands (median 1-2,
# bench/abort_latency.py). An abort that never lands runs to MAX_TOKENS, over
# 100 tokens past the trigger. PP=2 used to land late after the engine idled
# (vLLM's shared-memory queues back off); tests/processes/test_pp_idle_abort.py
# bounds that case.
ABORT_LATENCY_BOUND = 16
# name: (engine flags, CPU thread binding).
TOPOLOGIES = {
    "tp2": (["--tensor-parallel-size", "2"], "0|1"),
    "pp2": (["--pipeline-parallel-size", "2"], "0|1"),
}


def request(prompt: str, rid: str, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid, text=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), **fields)


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
async def topology_stack(request, tiny_llama_path, tmp_path_factory):
    flags, bind = TOPOLOGIES[request.param]
    router = stack.router(stack.free_port(), tmp_path_factory.mktemp("probes")).start()
    engine = stack.engine(tiny_llama_path, router.address, *flags, workers_bind=bind).start()
    try:
        await router.wait_health(want_serving=None, timeout=60)
        await engine.wait_health(want_serving=True, timeout=300)
        yield request.param, engine, router
    finally:
        engine.kill()
        router.kill()


async def test_probe_abort_under_topology(topology_stack):
    name, engine_service, router = topology_stack
    async with stack.channel(engine_service.address) as ch:
        engine = pb_grpc.EngineServiceStub(ch)
        info = (await engine.GetModelInfo(pb.GetModelInfoRequest())).model
        expected_ranks = {"tp2": [(0, 4), (0, 4)], "pp2": [(0, 2), (2, 4)]}[name]
        assert [(r.start_layer, r.end_layer) for r in info.ranks] == expected_ranks
        baseline = await asyncio.gather(*[
            stack.generate(engine, request(p, f"{name}-base-{i}", extraction_points=[probes.trace_point()]))
            for i, p in enumerate(PROMPTS)])
        rows = [probes.rows_by_position(o.batches) for o in baseline]
        for outcome, captured in zip(baseline, rows):
            first = outcome.finished.prompt_tokens
            assert sorted(captured) == list(range(first, first + MAX_TOKENS - 1))
        probe = probes.probe_firing_at(f"fires_{name}", rows[0], rows[1:], min_index=TRIGGER_MIN_INDEX)
        async with stack.channel(router.address) as admin_channel:
            await pb_grpc.ProbeAdminServiceStub(admin_channel).LoadProbe(probe.load_request())
        await stack.wait_for_probe(engine, probe.name)
        binding = pb.ProbeBinding(probe=probe.name, failure_policy=pb.FAILURE_POLICY_FAIL_CLOSED)
        aborted, other = await asyncio.gather(*[
            stack.generate(engine, request(p, f"{name}-probed-{i}", probes=[binding]))
            for i, p in enumerate(PROMPTS)])
    assert aborted.reason == "PROBE_ABORT"
    assert aborted.finished.verdict.token_position == probe.position
    trigger = probe.position - aborted.finished.prompt_tokens
    assert trigger == probe.position - baseline[0].finished.prompt_tokens
    assert TRIGGER_MIN_INDEX <= trigger < MAX_TOKENS - 2 * ABORT_LATENCY_BOUND
    assert aborted.tokens[: trigger + 1] == baseline[0].tokens[: trigger + 1]
    after_trigger = len(aborted.tokens) - (trigger + 1)
    print(f"{name}: abort latency {after_trigger} tokens after the triggering token")
    assert 0 <= after_trigger <= ABORT_LATENCY_BOUND
    assert aborted.finished.generated_tokens == len(aborted.tokens) < MAX_TOKENS
    assert other.reason == "LENGTH" and other.tokens == baseline[1].tokens
