"""The end-to-end abort under tensor and pipeline parallelism (real worker
processes): the probe fires at the same token, and only there."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

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
# 100 tokens past the trigger. A late PP=2 abort was once seen after the engine
# idled; test_abort_lands_promptly_after_the_engine_idles bounds that case.
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


@dataclass
class Armed:
    """A topology's engine with a probe loaded that fires first at a known token of PROMPTS[0]."""

    name: str
    engine: pb_grpc.EngineServiceStub
    baseline: list[stack.Outcome]
    probe: probes.FiringProbe

    @property
    def binding(self) -> pb.ProbeBinding:
        return pb.ProbeBinding(probe=self.probe.name, failure_policy=pb.FAILURE_POLICY_FAIL_CLOSED)

    def check_abort(self, aborted: stack.Outcome) -> int:
        """Asserts the verdict and where generation stopped; returns the tokens after the trigger."""
        assert aborted.reason == "PROBE_ABORT", aborted.finished
        assert aborted.finished.verdict.token_position == self.probe.position
        trigger = self.probe.position - aborted.finished.prompt_tokens
        assert trigger == self.probe.position - self.baseline[0].finished.prompt_tokens
        assert TRIGGER_MIN_INDEX <= trigger < MAX_TOKENS - 2 * ABORT_LATENCY_BOUND
        assert aborted.tokens[: trigger + 1] == self.baseline[0].tokens[: trigger + 1]
        after_trigger = len(aborted.tokens) - (trigger + 1)
        assert aborted.finished.generated_tokens == len(aborted.tokens) < MAX_TOKENS
        return after_trigger


@pytest.fixture(scope="module")
async def armed(topology_stack):
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
        yield Armed(name, engine, baseline, probe)


async def test_probe_abort_under_topology(armed):
    aborted, other = await asyncio.gather(*[
        stack.generate(armed.engine, request(p, f"{armed.name}-probed-{i}", probes=[armed.binding]))
        for i, p in enumerate(PROMPTS)])
    after_trigger = armed.check_abort(aborted)
    print(f"{armed.name}: abort latency {after_trigger} tokens after the triggering token")
    assert 0 <= after_trigger <= ABORT_LATENCY_BOUND
    assert other.reason == "LENGTH" and other.tokens == armed.baseline[1].tokens


# Longer than vLLM's shared-memory queue readers busy-spin (1 s) before they
# park, and than their 5 s re-check interval.
IDLE_S = 6.0
IDLE_ABORT_BOUND = 4
# The whole aborted request (about 10 tokens): 0.15-1.3 s measured here. One
# PP=2 request after 8 s idle in bench/abort_latency.py stalled 12 s (vLLM's
# queue readers re-check every 5 s when a wake-up is missed): this fails then.
IDLE_REQUEST_BOUND_S = 5.0


async def test_abort_lands_promptly_after_the_engine_idles(armed):
    """The first request after a quiet spell: its abort lands as soon as a warm one's."""
    await asyncio.sleep(IDLE_S)
    started = time.monotonic()
    aborted = await stack.generate(armed.engine, request(PROMPTS[0], f"{armed.name}-after-idle",
                                                         probes=[armed.binding]))
    after_trigger = armed.check_abort(aborted)
    print(f"{armed.name}: after {IDLE_S:.0f} s idle, abort latency {after_trigger} tokens, "
          f"request took {time.monotonic() - started:.2f} s")
    assert 0 <= after_trigger <= IDLE_ABORT_BOUND
    assert time.monotonic() - started < IDLE_REQUEST_BOUND_S
