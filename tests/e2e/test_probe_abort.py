"""A probe that fires on a known token aborts exactly its request at that
token; the other requests in the same batch finish untouched. A gated client
sees tokens only where the probes scored, and as soon as they did."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from common.verdict_log.store import Query, open_store
from tools import firing_probes, stack
from tools.aborts import until_within
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc
from undercurrent_client import cli

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox", "Hello, world! How are", "A probe is a small"]
MAX_TOKENS = 160
TRIGGER_MIN_INDEX = 4
# Tokens vLLM may generate after the triggering one before the abort lands:
# the verdict needs a drain, a router round trip and a scheduler step, a few ms
# and 0-1 tokens of this tiny model with the engine, the router and this client
# in one session (bench/abort_latency.py). An abort that never lands runs to
# MAX_TOKENS, over 150 tokens past the trigger.
ABORT_LATENCY_BOUND = 8


def request(prompt: str, rid: str, **fields) -> engine_pb.GenerateRequest:
    return engine_pb.GenerateRequest(
        request_id=rid, text=prompt,
        sampling=engine_pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), **fields,
    )


@pytest.fixture(scope="module")
async def baseline(engine_service):
    """Greedy tokens and layer-3 residual rows of each prompt, captured without any router."""
    async with stack.channel(engine_service.address) as ch:
        stub = engine_pb_grpc.EngineServiceStub(ch)
        outcomes = await asyncio.gather(*[
            stack.generate(stub, request(p, f"base-{i}", extraction_points=[firing_probes.trace_point()]))
            for i, p in enumerate(PROMPTS)
        ])
    for outcome in outcomes:
        assert outcome.reason == "LENGTH" and len(outcome.tokens) == MAX_TOKENS
        rows = firing_probes.rows_by_position(outcome.batches)
        prompt_tokens = outcome.finished.prompt_tokens
        # Every generated token but the last is fed back, so it has activations.
        assert sorted(rows) == list(range(prompt_tokens, prompt_tokens + MAX_TOKENS - 1))
    return outcomes


@pytest.fixture
async def firing_probe(baseline, start_router, engine):
    rows = [firing_probes.rows_by_position(o.batches) for o in baseline]
    probe = firing_probes.probe_firing_at("fires_on_a", rows[0], rows[1:], min_index=TRIGGER_MIN_INDEX)
    router = await start_router(0)
    async with stack.channel(router.address) as ch:
        info = (await admin_pb_grpc.ProbeAdminServiceStub(ch).LoadProbe(probe.load_request())).probe
    assert info.name == probe.name and info.action == types_pb.PROBE_ACTION_ABORT
    await stack.wait_for_probe(engine, probe.name)
    return probe


async def test_probe_aborts_exactly_the_request_it_fires_on(engine, baseline, firing_probe, router_ports):
    binding = types_pb.ProbeBinding(probe=firing_probe.name, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)

    async def attempt(number: int) -> int:
        outcomes = await asyncio.gather(*[
            stack.generate(engine, request(p, f"probed-{number}-{i}", probes=[binding]))
            for i, p in enumerate(PROMPTS)
        ])
        aborted, *others = outcomes
        assert aborted.reason == "PROBE_ABORT"
        verdict = aborted.finished.verdict
        assert verdict.probe == firing_probe.name and verdict.request_id == f"probed-{number}-0"
        assert verdict.token_position == firing_probe.position
        assert verdict.score >= firing_probe.threshold
        assert verdict.router == f"127.0.0.1:{router_ports[0]}"
        trigger_index = firing_probe.position - aborted.finished.prompt_tokens
        assert trigger_index == firing_probe.position - baseline[0].finished.prompt_tokens
        assert TRIGGER_MIN_INDEX <= trigger_index < MAX_TOKENS - 2 * ABORT_LATENCY_BOUND
        # Up to the trigger the probed run is the baseline run, token for token.
        shown = min(len(aborted.tokens), trigger_index + 1)
        assert aborted.tokens[:shown] == baseline[0].tokens[:shown]
        assert aborted.finished.generated_tokens == len(aborted.tokens) < MAX_TOKENS
        for outcome, base in zip(others, baseline[1:]):
            assert outcome.reason == "LENGTH", outcome.finished
            assert outcome.tokens == base.tokens
            assert outcome.finished.unprobed_tokens == 0 and outcome.finished.dropped_records == 0
        # Negative when the verdict overtook the triggering token on its way to the
        # client (rows and tokens leave the engine by different paths).
        return len(aborted.tokens) - (trigger_index + 1)

    latencies = await until_within(ABORT_LATENCY_BOUND, attempt)  # one abort within the bound
    print(f"abort latency: {latencies} tokens after the triggering token")
    assert min(latencies) <= ABORT_LATENCY_BOUND, latencies


async def test_gated_client_sees_no_token_at_or_after_the_trigger(engine, firing_probe):
    binding = types_pb.ProbeBinding(probe=firing_probe.name, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    outcome = await stack.generate(engine, request(PROMPTS[0], "gated-0", probes=[binding], gate_tokens=True))
    assert outcome.reason == "PROBE_ABORT"
    trigger_index = firing_probe.position - outcome.finished.prompt_tokens
    assert outcome.finished.verdict.token_position == firing_probe.position
    # Every token before the trigger is released, none at or after it.
    assert len(outcome.tokens) == trigger_index
    assert outcome.finished.generated_tokens > trigger_index


async def test_observe_binding_reports_scores_and_never_aborts(engine, baseline, firing_probe):
    binding = types_pb.ProbeBinding(probe=firing_probe.name, action=types_pb.PROBE_ACTION_OBSERVE, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    outcome = await stack.generate(engine, request(PROMPTS[0], "observed-0", probes=[binding]))
    assert outcome.reason == "LENGTH" and outcome.tokens == baseline[0].tokens
    scored = {p: s for event in outcome.scores for p, s in zip(event.token_positions, event.scores)}
    rows = firing_probes.rows_by_position(baseline[0].batches)
    assert sorted(scored) == sorted(rows)
    for position, score in scored.items():
        assert score == pytest.approx(firing_probe.score(rows[position]), rel=1e-4, abs=1e-4)
    assert scored[firing_probe.position] >= firing_probe.threshold


async def test_a_gated_request_probed_on_its_prompt_alone_streams_once_the_prompt_is_scored(
        engine_service, engine, baseline, start_router):
    """Generated positions owe such a probe no rows: the gate shows each token
    once its position is computed and the prompt scored, not all at the end."""
    hidden_size = next(iter(firing_probes.rows_by_position(baseline[1].batches).values())).size
    probe = firing_probes.LinearProbe("prompt_watch", np.zeros(hidden_size, np.float32), bias=0.0, threshold=1.0)
    router = await start_router(0)
    async with stack.channel(router.address) as ch:
        await admin_pb_grpc.ProbeAdminServiceStub(ch).LoadProbe(probe.load_request("observe", scope="prompt"))
    await stack.wait_for_probe(engine, "prompt_watch")
    binding = types_pb.ProbeBinding(probe="prompt_watch", failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    progress = stack.Outcome()
    # vLLM runs in short bursts, so the request is still running when its first token shows.
    with stack.vllm_paused(engine_service) as vllm:
        stream = asyncio.create_task(stack.generate(
            engine, request(PROMPTS[1], "prompt-gated", probes=[binding], gate_tokens=True), outcome=progress))
        async with asyncio.timeout(120):
            while not progress.tokens and not stream.done():
                await vllm.run_for(0.02)
                await asyncio.sleep(0.1)
        assert not stream.done(), f"the gate held every token until the finish: {stream.result().finished}"
    outcome = await asyncio.wait_for(stream, 120)
    assert outcome.reason == "LENGTH" and outcome.tokens == baseline[1].tokens, outcome.finished
    assert outcome.finished.unprobed_tokens == 0 and outcome.finished.dropped_records == 0
    scored = sorted(p for event in outcome.scores for p in event.token_positions)
    assert scored == list(range(outcome.finished.prompt_tokens))


async def test_the_verdict_log_keeps_the_abort_with_its_caller_and_replays_it(baseline, start_router, engine,
                                                                               tmp_path):
    """The abort a client received, in a router's verdict log: its request, the
    caller its token names, where and how it fired, and the input rows from
    which `undercurrent audit replay` gets the same score and verdict."""
    rows = [firing_probes.rows_by_position(o.batches) for o in baseline]
    probe = firing_probes.probe_firing_at("logged", rows[0], rows[1:], min_index=TRIGGER_MIN_INDEX)
    log = str(tmp_path / "verdicts.db")
    router = await start_router(0, None, "--verdict-log", log)
    async with stack.channel(router.address) as ch:
        info = (await admin_pb_grpc.ProbeAdminServiceStub(ch).LoadProbe(probe.load_request())).probe
    await stack.wait_for_probe(engine, probe.name)
    binding = types_pb.ProbeBinding(probe=probe.name, failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)
    outcome = await stack.generate(engine, request(PROMPTS[0], "logged-0", probes=[binding]))
    assert outcome.reason == "PROBE_ABORT"
    verdict = outcome.finished.verdict
    assert router.terminate() == 0  # a drained router has written its log

    store = open_store(log, create=False)
    [record] = store.records(Query())
    store.close()
    assert record.request_id.startswith("logged-0#") and record.caller == "demo"  # the client token's caller
    assert (record.kind, record.probe, record.version, record.digest, record.role) == (
        "abort", probe.name, "1", info.digest, "serving")
    assert (record.token_position, record.layer) == (verdict.token_position, firing_probes.LAYER)
    assert np.float32(record.score) == np.float32(verdict.score) and record.threshold == probe.threshold
    # The row the engine captured (the baseline ran in another batch: equal up to float32 sums' order).
    assert np.allclose(record.rows[0], rows[0][probe.position], rtol=1e-4, atol=1e-4)
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["audit", "replay", record.request_id, "--log", log], out=out, err=err) == 0, err.getvalue()
    assert "the same score and verdict" in out.getvalue()
