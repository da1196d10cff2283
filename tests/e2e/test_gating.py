"""The gating invariant through real processes: the e2e engine and real router
processes that differ in the probes and versions they hold, a version reloaded
mid-traffic, and a stateful guard whose replica is lost. Every check compares
the tokens released per position with each binding's own scores and report,
never with "any score"."""

from __future__ import annotations

import asyncio
import json

import pytest

from common.probe_format.files import write_probe
from tools import stack
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc

pytestmark = pytest.mark.vllm

CLOSED, OPEN = types_pb.FAILURE_POLICY_FAIL_CLOSED, types_pb.FAILURE_POLICY_FAIL_OPEN
GUARD = "always_fires"  # the norm of every generated row is >= 0: fires once min_tokens rows were seen
OBSERVER = "observer"
WATCH = "stateful_watch"  # never fires, but keeps state (min_tokens)
VERSIONED = "versioned_watch"
MIN_TOKENS = 6  # the guard fires at generated index MIN_TOKENS - 1
IN_FLIGHT = "undercurrent_router_link_rows_in_flight"
REPLICAS_UP = "undercurrent_router_link_replicas_up"


def norm_probe(name: str, layer: int, action: str, threshold: float, version: str = "1",
               min_tokens: int = 0) -> dict:
    """A probe of the residual norm of generated tokens (no weights)."""
    return {"name": name, "version": version, "kind": "norm", "tensor_type": "residual_stream", "layers": [layer],
            "hidden_size": 128, "dtype": "float32", "threshold": threshold, "action": action,
            "tokens": {"scope": "generated"}, "rule": {"min_tokens": min_tokens}}


def write_norm_probe(directory, *args, **kwargs) -> None:
    manifest = norm_probe(*args, **kwargs)
    write_probe(directory / manifest["name"], manifest)


def request(rid: str, *bindings: tuple[str, int], max_tokens: int = 40, gate: bool = True) -> engine_pb.GenerateRequest:
    message = engine_pb.GenerateRequest(
        request_id=rid, text=f"request {rid} says hello", gate_tokens=gate,
        sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    for probe, policy in bindings:
        message.probes.add(probe=probe, failure_policy=policy)
    return message


def report(outcome: stack.Outcome, probe: str) -> engine_pb.BindingReport:
    return next(b for b in outcome.finished.bindings if b.probe == probe)


def scores_of(outcome: stack.Outcome, probe: str) -> list[int]:
    return [p for event in outcome.scores if event.probe == probe for p in event.token_positions]


async def test_a_fail_open_probe_the_home_lacks_never_loosens_the_fail_closed_guard(engine, start_router, tmp_path):
    """Replica 0 holds the guard, replica 1 only the observer: every request lives
    on replica 0 (the one that serves its fail_closed guard), which refuses the
    observer. The refusal marks the observer's rows unprobed and nothing else:
    the guard still holds every token until it scored it, so no client sees the
    token it fired at or any after it."""
    write_norm_probe(tmp_path / "probes-0", GUARD, layer=1, action="abort", threshold=0.0, min_tokens=MIN_TOKENS)
    write_norm_probe(tmp_path / "probes-1", OBSERVER, layer=2, action="observe", threshold=1e9)
    await start_router(0, tmp_path / "probes-0")
    await start_router(1, tmp_path / "probes-1")
    await stack.wait_for_probe(engine, GUARD)
    await stack.wait_for_probe(engine, OBSERVER)
    outcomes = await asyncio.gather(*[
        stack.generate(engine, request(f"mixed-{i}", (GUARD, CLOSED), (OBSERVER, OPEN))) for i in range(12)])
    for outcome in outcomes:
        finished = outcome.finished
        trigger = finished.prompt_tokens + MIN_TOKENS - 1
        assert outcome.reason == "PROBE_ABORT", finished
        assert (finished.verdict.probe, finished.verdict.token_position) == (GUARD, trigger)
        # Every token before the trigger, scored by the guard; none from it on.
        assert len(outcome.tokens) == MIN_TOKENS - 1, (outcome.request_id, len(outcome.tokens), finished)
        guard, observer = report(outcome, GUARD), report(outcome, OBSERVER)
        assert guard.rows_scored >= MIN_TOKENS and guard.rows_unprobed == 0, guard
        assert (observer.rows_scored, scores_of(outcome, OBSERVER)) == (0, []), observer
        assert observer.rows_unprobed >= MIN_TOKENS and "not loaded" in observer.message, observer


async def test_a_reloaded_version_serves_new_requests_only_and_a_request_never_moves_to_another_version(
        engine_service, engine, engine_metrics_port, start_router, tmp_path):
    """Both replicas load version 1 of a probe; replica 1 is reloaded with version
    2 while requests run. Running requests keep the version they were bound to;
    new ones take their replica's version. Requests bound to version 1 whose
    replica is then lost move to replica 1, which refuses them (another version):
    fail_closed, they end ROUTER_UNAVAILABLE naming both versions, every token
    they showed scored by version 1."""
    for index in (0, 1):
        write_norm_probe(tmp_path / f"probes-{index}", VERSIONED, layer=1, action="observe", threshold=1e9)
    routers = [await start_router(i, tmp_path / f"probes-{i}") for i in (0, 1)]
    await stack.wait_for_probe(engine, VERSIONED)
    await stack.wait_metric(engine_metrics_port, REPLICAS_UP, lambda up: up == 2.0, timeout=60)
    version_2 = norm_probe(VERSIONED, layer=1, action="observe", threshold=1e9, version="2")
    progress = [stack.Outcome() for _ in range(8)]
    with stack.vllm_paused(engine_service) as vllm:
        long = [asyncio.create_task(stack.generate(engine, request(f"v1-{i}", (VERSIONED, CLOSED), max_tokens=1000),
                                                   outcome=outcome)) for i, outcome in enumerate(progress)]
        async with asyncio.timeout(120):  # every request scored on its replica, none near its end
            while not all(outcome.scores for outcome in progress):
                await vllm.run_for(0.02)
                await asyncio.sleep(0.1)
        await stack.wait_metric(engine_metrics_port, IN_FLIGHT, lambda rows: rows == 0.0, timeout=60)
        async with stack.channel(routers[1].address) as admin:
            reply = await admin_pb_grpc.ProbeAdminServiceStub(admin).LoadProbe(admin_pb.LoadProbeRequest(
                inline=admin_pb.InlineProbe(manifest_json=json.dumps(version_2)), replace=True))
        assert reply.probe.version == "2"
        routers[0].kill()
        await stack.wait_metric(engine_metrics_port, REPLICAS_UP, lambda up: up == 1.0, timeout=60)
    outcomes = await asyncio.gather(*long)
    moved = [o for o in outcomes if o.scores and o.scores[0].router == routers[0].address]
    stayed = [o for o in outcomes if o.scores and o.scores[0].router == routers[1].address]
    assert moved and stayed and len(moved) + len(stayed) == len(outcomes)
    for outcome in stayed:  # bound to version 1 on replica 1, which kept it for them
        assert outcome.reason == "LENGTH", outcome.finished
        assert (report(outcome, VERSIONED).version, outcome.finished.unprobed_tokens) == ("1", 0)
    for outcome in moved:
        assert outcome.reason == "ROUTER_UNAVAILABLE", outcome.finished
        assert "is version '2'" in outcome.finished.message and "(fail_closed)" in outcome.finished.message
        assert report(outcome, VERSIONED).version == "1"
        prompt = outcome.finished.prompt_tokens
        released = range(prompt, prompt + len(outcome.tokens))
        assert set(released) <= set(scores_of(outcome, VERSIONED)), "a token shown unscored by version 1"
    # New requests take the version of the replica left.
    fresh = await stack.generate(engine, request("v2-new", (VERSIONED, CLOSED), max_tokens=6))
    assert fresh.reason == "LENGTH" and report(fresh, VERSIONED).version == "2"


@pytest.mark.parametrize("policy", [CLOSED, OPEN], ids=["fail_closed", "fail_open"])
async def test_a_stateful_guard_whose_replica_is_lost_never_restarts_silently(
        engine_service, engine, engine_metrics_port, start_router, tmp_path, policy):
    """A probe that keeps state (min_tokens) scored a request on one replica, which
    is then lost with nothing in flight: on the replica it moves to, the probe
    would start afresh. fail_closed: the request ends ROUTER_UNAVAILABLE saying
    so. fail_open: it goes on, and its finish counts the restart and says why."""
    for index in (0, 1):
        write_norm_probe(tmp_path / f"probes-{index}", WATCH, layer=1, action="observe", threshold=1e9,
                         min_tokens=MIN_TOKENS)
    routers = [await start_router(i, tmp_path / f"probes-{i}") for i in (0, 1)]
    await stack.wait_for_probe(engine, WATCH)
    await stack.wait_metric(engine_metrics_port, REPLICAS_UP, lambda up: up == 2.0, timeout=60)
    progress = stack.Outcome()
    with stack.vllm_paused(engine_service) as vllm:
        running = asyncio.create_task(stack.generate(
            engine, request(f"stateful-{policy}", (WATCH, policy), max_tokens=1000), outcome=progress))
        async with asyncio.timeout(120):
            while len(scores_of(progress, WATCH)) < 3:
                await vllm.run_for(0.02)
                await asyncio.sleep(0.1)
        await stack.wait_metric(engine_metrics_port, IN_FLIGHT, lambda rows: rows == 0.0, timeout=60)
        home = progress.scores[0].router
        next(r for r in routers if r.address == home).kill()
        await stack.wait_metric(engine_metrics_port, REPLICAS_UP, lambda up: up == 1.0, timeout=60)
    outcome = await running
    watch = report(outcome, WATCH)
    if policy == CLOSED:
        assert outcome.reason == "ROUTER_UNAVAILABLE", outcome.finished
        assert f"the state of stateful probe(s) '{WATCH}' was lost" in outcome.finished.message
        # Every token shown was scored on the replica that held the probe's state.
        prompt = outcome.finished.prompt_tokens
        on_home = {p for event in outcome.scores if event.router == home for p in event.token_positions}
        assert set(range(prompt, prompt + len(outcome.tokens))) <= on_home
    else:
        assert outcome.reason == "LENGTH", outcome.finished
        assert watch.state_restarts == 1 and "probe state restarted on" in watch.message, watch
        assert [event.router for event in outcome.scores][-1] != home  # scored on, with a fresh state


FUZZ_WATCH, FUZZ_GUARD = "fuzz_watch", "fuzz_guard"
FUZZ_GUARD_MIN_TOKENS = 8
FUZZ_SCHEDULES = 6


async def test_random_bindings_under_a_random_fault_schedule_keep_the_invariant(
        engine, engine_metrics_port, start_router, tmp_path):
    """Seeded random schedules: requests bind the real probes loaded on two router
    processes (one lacks the guard) with random policies and gating, while a
    router is killed and restarted at random moments. Every stream ends with one
    finish; a gated request shows no token its fail_closed watch did not score
    nor any at or past its guard's trigger; each binding's report counts exactly
    the scores the client was shown; no request is left running."""
    import random

    for index in (0, 1):
        write_norm_probe(tmp_path / f"probes-{index}", FUZZ_WATCH, layer=1, action="observe", threshold=1e9)
    write_norm_probe(tmp_path / "probes-0", FUZZ_GUARD, layer=2, action="abort", threshold=0.0,
                     min_tokens=FUZZ_GUARD_MIN_TOKENS)
    routers = [await start_router(i, tmp_path / f"probes-{i}") for i in (0, 1)]
    await stack.wait_for_probe(engine, FUZZ_GUARD)
    await stack.wait_metric(engine_metrics_port, REPLICAS_UP, lambda up: up == 2.0, timeout=60)
    for seed in range(FUZZ_SCHEDULES):
        rng = random.Random(seed)
        requests = []
        for i in range(3):
            bindings = [(FUZZ_WATCH, rng.choice((CLOSED, OPEN)))]
            if rng.random() < 0.5:
                bindings.append((FUZZ_GUARD, rng.choice((CLOSED, OPEN))))
            requests.append(request(f"fuzz-{seed}-{i}", *bindings, max_tokens=rng.choice((12, 60, 300)),
                                    gate=rng.random() < 0.7))
        progress = [stack.Outcome() for _ in requests]
        running = [asyncio.create_task(stack.generate(engine, r, outcome=o)) for r, o in zip(requests, progress)]
        victim = rng.choice((0, 1, None))
        if victim is not None:
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            routers[victim].kill()
        outcomes = await asyncio.gather(*running)
        if victim is not None:
            routers[victim] = await start_router(victim, tmp_path / f"probes-{victim}")
            await stack.wait_metric(engine_metrics_port, REPLICAS_UP, lambda up: up == 2.0, timeout=60)
        for message, outcome in zip(requests, outcomes):
            check_fuzzed(message, outcome, fault=victim is not None)
    assert stack.running_requests(engine_metrics_port) == 0


def check_fuzzed(message: engine_pb.GenerateRequest, outcome: stack.Outcome, fault: bool) -> None:
    policies = {b.probe: b.failure_policy for b in message.probes}
    finished = outcome.finished
    allowed = {"LENGTH"} | ({"PROBE_ABORT"} if FUZZ_GUARD in policies else set())
    if fault and CLOSED in policies.values():
        allowed.add("ROUTER_UNAVAILABLE")
    assert outcome.reason in allowed, (message.request_id, finished)
    shown = set(range(finished.prompt_tokens, finished.prompt_tokens + len(outcome.tokens)))
    if outcome.reason == "LENGTH":  # no stage computes the last token of a finished request
        shown.discard(finished.prompt_tokens + len(outcome.tokens) - 1)
    watch = report(outcome, FUZZ_WATCH)
    assert watch.rows_scored == len(scores_of(outcome, FUZZ_WATCH)), (message.request_id, watch)
    if not message.gate_tokens:
        return
    if policies[FUZZ_WATCH] == CLOSED:
        assert shown <= set(scores_of(outcome, FUZZ_WATCH)), (message.request_id, finished)
    if policies.get(FUZZ_GUARD) == CLOSED or outcome.reason == "PROBE_ABORT":
        assert len(outcome.tokens) < FUZZ_GUARD_MIN_TOKENS, (message.request_id, len(outcome.tokens), finished)
