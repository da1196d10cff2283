"""An engine armed with a probe that fires at a known token, for the abort tests
of every engine topology (real worker processes, real router) and the compose test."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tools import firing_probes, stack
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

PROMPTS = ["The quick brown fox", "Hello, world! How are"]
MAX_TOKENS = 200
TRIGGER_MIN_INDEX = 3
# Tokens generated after the triggering one before the abort lands: 0 to 2 in
# every request of bench/abort_latency.py at TP=1, TP=2 and PP=2, with the
# engine, the router and the client in one session (tools/processes.py; in
# separate sessions the router waited seconds for a CPU and aborts ran up to
# 190 tokens late). An abort that never lands runs to
# MAX_TOKENS, over 190 tokens past the trigger.
ABORT_LATENCY_BOUND = 8
# A load spike that keeps the router from a CPU delays one abort (TP=2 once
# measured 154 in CI); an abort path that is slow, or never lands, is so in
# every attempt. So one of ATTEMPTS aborts must land within the bound, each
# attempt checked in full.
ATTEMPTS = 3
# These tests time aborts, not router outages: with the e2e stack's 1.5 s router
# timeout, the request that is not aborted ended ROUTER_UNAVAILABLE (fail_closed)
# in half of the TP=2 runs at a load average of 16-22, the router process
# waiting that long for a CPU. Engines for these tests pass this instead.
ROUTER_TIMEOUT_S = 10.0


async def until_within(bound: int, attempt: Callable[[int], Awaitable[int]]) -> list[int]:
    """Runs attempt(0), attempt(1), ... (each checks its requests in full and returns
    the tokens its abort landed after the trigger) until one lands within `bound`,
    at most ATTEMPTS; returns every attempt's figure."""
    latencies: list[int] = []
    for number in range(ATTEMPTS):
        latencies.append(await attempt(number))
        if latencies[-1] <= bound:
            break
    return latencies


def request(prompt: str, rid: str, **fields) -> engine_pb.GenerateRequest:
    return engine_pb.GenerateRequest(
        request_id=rid, text=prompt,
        sampling=engine_pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), **fields)


@dataclass
class Armed:
    """A topology's engine with a probe loaded that fires first at a known token of PROMPTS[0]."""

    name: str
    engine: engine_pb_grpc.EngineServiceStub
    baseline: list[stack.Outcome]
    probe: firing_probes.FiringProbe

    @property
    def binding(self) -> types_pb.ProbeBinding:
        return types_pb.ProbeBinding(probe=self.probe.name, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)

    def check_abort(self, aborted: stack.Outcome) -> int:
        """Asserts the verdict and where generation stopped; returns the tokens after the trigger."""
        assert aborted.reason == "PROBE_ABORT", aborted.finished
        assert aborted.finished.verdict.token_position == self.probe.position
        trigger = self.probe.position - aborted.finished.prompt_tokens
        assert trigger == self.probe.position - self.baseline[0].finished.prompt_tokens
        assert TRIGGER_MIN_INDEX <= trigger < MAX_TOKENS - 2 * ABORT_LATENCY_BOUND
        shown = min(len(aborted.tokens), trigger + 1)
        assert aborted.tokens[:shown] == self.baseline[0].tokens[:shown]
        # Negative when the verdict overtook the triggering token on its way to
        # the client (rows and tokens leave the engine by different paths).
        after_trigger = len(aborted.tokens) - (trigger + 1)
        # A verdict that reached the engine only after vLLM decoded every token
        # still ends the request PROBE_ABORT: a late abort, over the bound (CI
        # measured one at PP=2), not a wrong one.
        assert aborted.finished.generated_tokens == len(aborted.tokens) <= MAX_TOKENS
        return after_trigger

    async def abort_latencies(self, tag: str) -> list[int]:
        """Probed pairs until an abort lands within ABORT_LATENCY_BOUND, at most
        ATTEMPTS: the tokens after the trigger of each. The other request runs
        to its end untouched in every pair."""
        return await until_within(ABORT_LATENCY_BOUND, lambda number: self.checked_pair(f"{tag}-{number}"))

    async def checked_pair(self, tag: str) -> int:
        """One probed pair, each request checked in full (the other runs to its end
        untouched); returns the tokens the abort landed after the trigger."""
        aborted, other = await self.probed_pair(tag)
        after_trigger = self.check_abort(aborted)
        assert other.reason == "LENGTH" and other.tokens == self.baseline[1].tokens, other.finished
        return after_trigger

    async def probed_pair(self, tag: str) -> tuple[stack.Outcome, stack.Outcome]:
        """PROMPTS run concurrently with the probe bound: (the aborted one, the other)."""
        aborted, other = await asyncio.gather(*[
            stack.generate(self.engine, request(p, f"{self.name}-{tag}-{i}", probes=[self.binding]))
            for i, p in enumerate(PROMPTS)])
        return aborted, other


async def arm(name: str, engine: engine_pb_grpc.EngineServiceStub, router_address: str) -> Armed:
    """Runs PROMPTS once with the trace point, builds a probe that fires at a
    token of the first, and loads it into the router."""
    armed = await armed_with_probe_to_load(name, engine)
    async with stack.channel(router_address) as admin_channel:
        await admin_pb_grpc.ProbeAdminServiceStub(admin_channel).LoadProbe(armed.probe.load_request())
    await stack.wait_for_probe(engine, armed.probe.name)
    return armed


async def armed_with_probe_to_load(name: str, engine: engine_pb_grpc.EngineServiceStub) -> Armed:
    """Runs PROMPTS once with the trace point and builds a probe that fires at a
    token of the first; the caller loads it into the routers."""
    baseline = await asyncio.gather(*[
        stack.generate(engine, request(p, f"{name}-base-{i}", extraction_points=[firing_probes.trace_point()]))
        for i, p in enumerate(PROMPTS)])
    rows = [firing_probes.rows_by_position(o.batches) for o in baseline]
    for outcome, captured in zip(baseline, rows):
        first = outcome.finished.prompt_tokens
        assert sorted(captured) == list(range(first, first + MAX_TOKENS - 1))
    probe = firing_probes.probe_firing_at(f"fires_{name}", rows[0], rows[1:], min_index=TRIGGER_MIN_INDEX)
    return Armed(name, engine, list(baseline), probe)
