"""Real faults between a real engine and its router, each checked for the policy,
the counts in GenerateFinished, a stated recovery time, and router state back to
zero (read from the router's Prometheus metrics)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.faults import harness
from tests.faults.harness import ROUTER_TIMEOUT_S
from tests.faults.routers import ErroringRouter, KeyRecordingRouter, probe_info
from tools import stack
from tools.router_double import of_client
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

CLOSED, OPEN = types_pb.FAILURE_POLICY_FAIL_CLOSED, types_pb.FAILURE_POLICY_FAIL_OPEN
LONG = 900  # tokens: far more than a request generates before any fault ends it
POLICY_ENDS = 'undercurrent_engine_aborts_total{reason="ROUTER_UNAVAILABLE"}'
# Router state after a silent fault heals: the engine gave up on the silent
# session (at most its 6 s heartbeat timeout), reconnects with backoff, and the
# router drops the old session's requests when that connection closes.
HEAL_SETTLE_S = 15.0


def start(engine, rid: str, policy: int, max_tokens: int = LONG, gate: bool = False,
          probe: str = harness.WATCH) -> tuple[asyncio.Task, stack.Outcome]:
    progress = stack.Outcome()
    task = asyncio.create_task(stack.generate(
        engine, harness.request(rid, policy, max_tokens, probe=probe, gate=gate), outcome=progress))
    return task, progress


async def test_router_sigkill_releases_no_unscored_gated_token(engine, start_router):
    router = await start_router()
    task, progress = start(engine, "kill-gated", CLOSED, gate=True)
    await harness.wait_tokens(progress, 20)
    killed_at = time.monotonic()
    router.kill()
    outcome = await task
    ended_after = time.monotonic() - killed_at

    assert outcome.reason == "ROUTER_UNAVAILABLE", outcome.finished
    assert "fail_closed" in outcome.finished.verdict.reason
    assert ended_after < ROUTER_TIMEOUT_S + stack.END_SLACK_S, f"ended {ended_after:.2f} s after the kill"
    stack.assert_released_tokens_were_scored(outcome)
    # The verdict's position is the first unscored row: nothing at or after it was released.
    prompt = outcome.finished.prompt_tokens
    assert prompt + len(outcome.tokens) <= outcome.finished.verdict.token_position, outcome.finished
    assert outcome.finished.generated_tokens > len(outcome.tokens), "gating withheld nothing"
    harness.assert_true_counts(outcome)

    # Recovery: a new router behind the same address probes new requests again.
    restarted_at = time.monotonic()
    fresh = await start_router()
    again = await stack.generate(engine, harness.request("after-kill", CLOSED, 12, gate=True))
    print(f"router SIGKILL: ended {ended_after:.2f} s after; probed again "
          f"{time.monotonic() - restarted_at:.2f} s after the restart began")
    assert again.reason == "LENGTH" and again.finished.unprobed_tokens == 0
    assert len(stack.scored_positions(again)) == 11
    await harness.wait_router_state(fresh.metrics_port, sessions=1, live_requests=0)


class Blackhole:
    name = "blackhole"

    def __init__(self, proxy, router):
        self.proxy, self.router = proxy, router

    def inject(self):
        self.proxy.blackhole()

    def heal(self):
        self.proxy.restore()


class StoppedRouter(Blackhole):
    """SIGSTOP: the router reads nothing and answers nothing; its TCP connection stays open."""

    name = "sigstop"

    def inject(self):
        self.router.stop()

    def heal(self):
        self.router.resume()


@pytest.mark.parametrize("fault_kind", [Blackhole, StoppedRouter], ids=lambda k: k.name)
async def test_silent_router(engine_service, engine, start_router, proxy, fault_kind):
    router = await start_router()
    fault = fault_kind(proxy, router)
    closed, closed_progress = start(engine, f"{fault.name}-closed", CLOSED, gate=True)
    opened, open_progress = start(engine, f"{fault.name}-open", OPEN)
    await harness.wait_tokens(closed_progress, 15)
    await harness.wait_tokens(open_progress, 15)
    # vLLM holds still while the fault goes in: a loaded client can see its 15th
    # token after the tiny model has decoded the whole request.
    with stack.vllm_paused(engine_service):
        assert not (closed.done() or opened.done()), "a request ended before the fault"
        began = time.monotonic()
        fault.inject()
    open_tokens_at_fault = len(open_progress.tokens)  # printed only: the client may lag the engine
    try:
        closed_outcome = await closed
        ended_after = time.monotonic() - began
        open_outcome = await opened
    finally:
        fault.heal()

    # fail_closed: silence is found by the router timeout's watchdog (the session's
    # heartbeat check would take harness.HEARTBEAT_TIMEOUT_S), or sooner, when the
    # fail_open request's later steps fill the send queue and drop_oldest drops the
    # message holding the fail_closed rows: which comes first depends on how fast
    # vLLM decodes. Either way the request ends with its own reason, and gating
    # released nothing unscored.
    assert closed_outcome.reason == "ROUTER_UNAVAILABLE", closed_outcome.finished
    message = closed_outcome.finished.message
    if "rows dropped before reaching a router (drop_oldest)" in message:
        assert ended_after < ROUTER_TIMEOUT_S + stack.END_SLACK_S, f"ended {ended_after:.2f} s after the fault"
    else:
        assert "acknowledged no rows for 10 s (router timeout)" in message, message
        assert ROUTER_TIMEOUT_S - 1 < ended_after < ROUTER_TIMEOUT_S + stack.END_SLACK_S, (
            f"ended {ended_after:.2f} s after the fault")
    assert ROUTER_TIMEOUT_S + stack.END_SLACK_S < harness.HEARTBEAT_TIMEOUT_S
    stack.assert_released_tokens_were_scored(closed_outcome)
    harness.assert_true_counts(closed_outcome)

    # fail_open: finishes, and counts exactly the rows no router answered.
    assert open_outcome.reason == "LENGTH" and len(open_outcome.tokens) == LONG
    harness.assert_true_counts(open_outcome)
    unprobed = open_outcome.finished.unprobed_tokens
    after_fault = harness.fed_positions(open_outcome) - open_tokens_at_fault
    # Scoring stopped at the fault: the scored rows are the first ones fed, every
    # later one is unprobed (with assert_true_counts). Where the fault fell is the
    # engine's business: on a loaded host the client saw 60 tokens at the fault
    # while the router had already scored 272 positions, so the client's view
    # bounds nothing.
    assert unprobed > 0
    scored = stack.scored_positions(open_outcome)
    prompt = open_outcome.finished.prompt_tokens
    assert scored == list(range(prompt, prompt + len(scored))), scored

    healed = await harness.wait_router_state(router.metrics_port, sessions=1, live_requests=0,
                                             timeout=HEAL_SETTLE_S)
    print(f"{fault.name}: fail_closed ended {ended_after:.2f} s after the fault; "
          f"{unprobed} unprobed, {after_fault} generated after the client saw it; router state back "
          f"{healed:.2f} s after healing")
    again = await stack.generate(engine, harness.request(f"{fault.name}-again", CLOSED, 12))
    assert again.reason == "LENGTH" and again.finished.unprobed_tokens == 0


async def test_router_answering_every_batch_with_an_error(engine_service, engine, engine_metrics_port, proxy):
    router = await ErroringRouter("fails").start()
    try:
        proxy.retarget(router.address)
        await stack.wait_for_probe(engine, "fails", timeout=60)
        ended = (await harness.metrics(engine_metrics_port)).get(POLICY_ENDS, 0.0)
        # vLLM runs in short bursts until the router has answered the fail_closed
        # request, then holds until the engine has ended it: the engine must end it
        # on its own, not because the tiny model reached max_tokens first (unpaced, it
        # decoded all 900 tokens before the first error reached the engine in CI).
        with stack.vllm_paused(engine_service) as vllm:
            closed, _ = start(engine, "errors-closed", CLOSED, gate=True, probe="fails")
            opened, _ = start(engine, "errors-open", OPEN, max_tokens=60, probe="fails")
            async with asyncio.timeout(120):
                while not any(key.startswith("errors-closed#") for key in router.errored):
                    await vllm.run_for(0.02)
                    await asyncio.sleep(0.1)
            await stack.wait_metric(engine_metrics_port, POLICY_ENDS, lambda count: count > ended, timeout=60)
        closed_outcome, open_outcome = await asyncio.wait_for(asyncio.gather(closed, opened), 120)

        # fail_closed: an error is not a score; the request ends, and nothing was released.
        assert closed_outcome.reason == "ROUTER_UNAVAILABLE", closed_outcome.finished
        assert "INTERNAL" in closed_outcome.finished.message and "(fail_closed)" in closed_outcome.finished.message
        assert closed_outcome.tokens == [], "gated tokens were released although no row was scored"
        assert closed_outcome.finished.generated_tokens < LONG
        # fail_open: finishes, every fed row counted unprobed.
        assert open_outcome.reason == "LENGTH"
        assert open_outcome.finished.unprobed_tokens == harness.fed_positions(open_outcome) == 59
        assert router.errors_sent > 0
        await router.wait_for(lambda: all(r.ended for r in router.requests.values()
                                          if r.starts[0].request_id.startswith("errors-")))
    finally:
        proxy.drop_connections()
        await router.kill()


OVERFLOW_TOKENS = 300


@pytest.mark.parametrize("policy", [CLOSED, OPEN], ids=["fail_closed", "fail_open"])
async def test_send_queue_overflow(engine, proxy, engine_metrics_port, policy):
    """A router that keeps its session alive (heartbeats) but stops reading: the
    send queue (conftest.SEND_QUEUE messages) overflows and drops by policy, counted."""
    router = KeyRecordingRouter("slow")
    # Without BDP probing the double's transport keeps HTTP/2's 64 KiB window: a
    # router that stops reading pushes back after ~0.13 MB. With it, the window
    # grows to whatever the link measured (~6 MB absorbed here), and whether the
    # queue fills before the router timeout depends on the host's speed.
    router.transport_options = [("grpc.http2.bdp_probe", 0)]
    router.probes = [probe_info("slow"), probe_info("slow_mlp")]
    router.probes[1].tensor_type = types_pb.TENSOR_TYPE_MLP_OUT
    for info in router.probes:
        info.tokens.scope = types_pb.TokenSelector.SCOPE_ALL
    await router.start()
    try:
        proxy.retarget(router.address)
        await stack.wait_for_probe(engine, "slow", timeout=60)
        before = await harness.metrics(engine_metrics_port)
        router.reading.clear()
        requests = []
        for i in range(3):
            # Long prompts with every row captured fill the transport's windows at once.
            message = engine_pb.GenerateRequest(
                request_id=f"overflow-{policy}-{i}", token_ids=engine_pb.TokenIds(ids=[5 + i + 10 * policy] * 700),
                sampling=engine_pb.SamplingParams(max_tokens=OVERFLOW_TOKENS, temperature=0, ignore_eos=True))
            message.probes.add(probe="slow", failure_policy=policy)
            message.probes.add(probe="slow_mlp", failure_policy=policy)
            requests.append(asyncio.create_task(stack.generate(engine, message)))
        outcomes = await asyncio.wait_for(asyncio.gather(*requests), 120)
        after = await harness.metrics(engine_metrics_port)
    finally:
        router.reading.set()
        proxy.drop_connections()
        await router.kill()

    dropped = sum(o.finished.dropped_records for o in outcomes)
    overflowed = harness.engine_dropped(after, "drop_oldest") - harness.engine_dropped(before, "drop_oldest")
    assert dropped > 0, [o.finished for o in outcomes]
    assert overflowed > 0, "the engine's metrics did not count the overflow"
    for outcome in outcomes:
        if policy == CLOSED:
            assert outcome.reason == "ROUTER_UNAVAILABLE", outcome.finished
            assert "drop_oldest" in outcome.finished.message, outcome.finished
        else:
            assert outcome.reason == "LENGTH" and len(outcome.tokens) == OVERFLOW_TOKENS
            assert outcome.finished.dropped_records > 0 and outcome.finished.unprobed_tokens > 0


async def test_router_restart_under_load(engine, start_router):
    router = await start_router()
    policies = [CLOSED, OPEN] * 3
    running = [start(engine, f"restart-{i}", p, max_tokens=300) for i, p in enumerate(policies)]
    for _, progress in running:
        await harness.wait_tokens(progress, 10)
    killed_at = time.monotonic()
    router.kill()
    fresh = await start_router(port=router.service.port, wait_probe=False)
    outcomes = await asyncio.gather(*[task for task, _ in running])
    for policy, outcome in zip(policies, outcomes):
        scored = stack.scored_positions(outcome)
        assert len(scored) == len(set(scored)) and scored == sorted(scored)
        if policy == CLOSED and outcome.reason != "LENGTH":
            assert outcome.reason == "ROUTER_UNAVAILABLE", outcome.finished
            harness.assert_true_counts(outcome)
        elif policy == CLOSED:  # re-homed in time: every row scored
            assert outcome.finished.unprobed_tokens == 0
            assert len(scored) == harness.fed_positions(outcome) == 299
        else:
            assert outcome.reason == "LENGTH" and len(outcome.tokens) == 300
            harness.assert_true_counts(outcome)
    await stack.wait_for_probe(engine, harness.WATCH)
    again = await asyncio.gather(*[
        stack.generate(engine, harness.request(f"after-restart-{i}", CLOSED, 16)) for i in range(4)])
    print(f"restart under load: new requests probed {time.monotonic() - killed_at:.2f} s after the kill")
    for outcome in again:
        assert outcome.reason == "LENGTH" and outcome.finished.unprobed_tokens == 0
        assert len(stack.scored_positions(outcome)) == 15
    await harness.wait_router_state(fresh.metrics_port, sessions=1, live_requests=0)


LOAD_SECONDS = 12.0
CLIENTS = 8


async def test_exactly_once_under_load(engine, proxy, engine_metrics_port):
    """Every (request, position, layer) row arrives exactly once, in order, or is counted dropped."""
    router = await KeyRecordingRouter("keys").start()
    outcomes: list[stack.Outcome] = []
    try:
        proxy.retarget(router.address)
        await stack.wait_for_probe(engine, "keys", timeout=60)
        before = await harness.metrics(engine_metrics_port)
        deadline = time.monotonic() + LOAD_SECONDS

        async def client(index: int) -> None:
            turn = 0
            while time.monotonic() < deadline:
                max_tokens = 8 + (index * 7 + turn * 5) % 33
                outcomes.append(await stack.generate(engine, harness.request(
                    f"once-{index}-{turn}", OPEN, max_tokens, probe="keys")))
                turn += 1

        await asyncio.gather(*[client(i) for i in range(CLIENTS)])
        after = await harness.metrics(engine_metrics_port)
        await router.wait_for(lambda: all(of_client(router.requests, o.request_id).ended for o in outcomes))
    finally:
        proxy.drop_connections()
        await router.kill()

    rows = dropped = 0
    for outcome in outcomes:
        assert outcome.reason == "LENGTH", outcome.finished
        batches = of_client(router.keys, outcome.request_id)
        keys = [key for batch in batches for key in batch]
        prompt = outcome.finished.prompt_tokens
        owed = [(p, layer) for p in range(prompt, prompt + harness.fed_positions(outcome))
                for layer in (0, 1, 2, 3)]
        assert len(set(keys)) == len(keys), f"{outcome.request_id}: a row arrived twice"
        # A batch is the unit a router scores (its blocks go layer by layer, and
        # one drain may hold several steps); batches arrive in (position, layer)
        # order: every key of a batch comes after every key of the batches before.
        in_order = [key for batch in batches for key in sorted(batch)]
        assert in_order == sorted(keys), f"{outcome.request_id}: batches out of (position, layer) order"
        assert set(keys) <= set(owed), f"{outcome.request_id}: rows nobody asked for"
        assert len(owed) - len(keys) == outcome.finished.dropped_records, outcome.finished
        rows += len(keys)
        dropped += outcome.finished.dropped_records
    engine_dropped = sum(v for k, v in after.items() if k.startswith("undercurrent_router_link_dropped_records_total")) \
        - sum(v for k, v in before.items() if k.startswith("undercurrent_router_link_dropped_records_total"))
    assert engine_dropped == dropped
    print(f"exactly-once: {len(outcomes)} requests, {rows} rows once each, {dropped} counted dropped "
          f"in {LOAD_SECONDS:.0f} s with {CLIENTS} clients")
    assert len(outcomes) >= CLIENTS * 2
