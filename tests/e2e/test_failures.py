"""Routers die and come back; replicas split the load; the engine keeps serving."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import numpy as np
import pytest

from common.probe_format.files import write_probe
from tools import stack
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

pytestmark = pytest.mark.vllm

WATCH = "watch_norm"


def write_watch_probe(directory, hidden: int = 128) -> None:
    """Observes every generated token's layer-1 residual norm; never fires."""
    write_probe(directory / WATCH, {
        "name": WATCH, "version": "1", "kind": "norm", "tensor_type": "residual_stream",
        "layers": [1], "hidden_size": hidden, "dtype": "float32", "threshold": 1e9,
        "action": "observe", "tokens": {"scope": "generated"},
    })


def request(rid: str, policy: int, max_tokens: int = 12) -> engine_pb.GenerateRequest:
    message = engine_pb.GenerateRequest(
        request_id=rid, text=f"request {rid} says hello",
        sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    message.probes.add(probe=WATCH, failure_policy=policy)
    return message


@pytest.fixture
async def two_routers(start_router, tmp_path, engine):
    for index in (0, 1):
        write_watch_probe(tmp_path / f"probes-{index}")
    routers = [await start_router(i, tmp_path / f"probes-{i}") for i in (0, 1)]
    await stack.wait_for_probe(engine, WATCH)
    await wait_until_both_score(engine, {r.address for r in routers})
    return routers


REHOMED = "undercurrent_router_link_rehomed_requests_total"
REPLICAS_UP = "undercurrent_router_link_replicas_up"


async def wait_until_both_score(engine, addresses: set[str], timeout: float = 60) -> None:
    """The engine reconnects with backoff, so the second session may come up
    seconds after the first: probe with short requests until both replicas score."""
    seen: set[str] = set()
    deadline = asyncio.get_running_loop().time() + timeout
    attempt = 0
    while seen != addresses:
        assert asyncio.get_running_loop().time() < deadline, f"only {seen} scored"
        outcomes = await asyncio.gather(
            *[stack.generate(engine, request(f"warm-{attempt}-{i}", types_pb.FAILURE_POLICY_FAIL_OPEN, 2)) for i in range(4)])
        seen |= {event.router for outcome in outcomes for event in outcome.scores}
        attempt += 1


async def test_two_replicas_split_requests_and_keep_each_on_one(engine, two_routers):
    outcomes = await asyncio.gather(
        *[stack.generate(engine, request(f"split-{i}", types_pb.FAILURE_POLICY_FAIL_CLOSED, 6)) for i in range(12)]
    )
    homes = {}
    for outcome in outcomes:
        assert outcome.reason == "LENGTH"
        replicas = {event.router for event in outcome.scores}
        assert len(replicas) == 1, f"{outcome.request_id} was scored by {replicas}"
        positions = [p for event in outcome.scores for p in event.token_positions]
        assert sorted(positions) == positions and len(set(positions)) == len(positions) == 5
        homes[outcome.request_id] = replicas.pop()
    counts = Counter(homes.values())
    assert set(counts) == {r.address for r in two_routers}, counts


async def test_killed_router_fails_closed_and_open_requests_by_policy(engine, start_router, tmp_path):
    write_watch_probe(tmp_path / "probes-0")
    router = await start_router(0, tmp_path / "probes-0")
    await stack.wait_for_probe(engine, WATCH)
    long = 1000
    both_scored = [asyncio.Event(), asyncio.Event()]
    closed = asyncio.create_task(
        stack.generate(engine, request("closed", types_pb.FAILURE_POLICY_FAIL_CLOSED, long), scored=both_scored[0]))
    opened = asyncio.create_task(
        stack.generate(engine, request("open", types_pb.FAILURE_POLICY_FAIL_OPEN, long), scored=both_scored[1]))
    for event in both_scored:
        await asyncio.wait_for(event.wait(), 60)
    router.kill()
    closed_outcome, open_outcome = await asyncio.gather(closed, opened)
    # Aborted once no router was reachable for --router-timeout, or, had it
    # finished first, still not reported as a clean finish.
    assert closed_outcome.reason == "ROUTER_UNAVAILABLE"
    assert "fail_closed" in closed_outcome.finished.verdict.reason
    assert open_outcome.reason == "LENGTH" and len(open_outcome.tokens) == long
    scored = sum(len(e.token_positions) for e in open_outcome.scores)
    unprobed = open_outcome.finished.unprobed_tokens
    assert scored > 0 and unprobed > 0
    # Every fed token (all but the last; one row each) is scored or counted
    # unprobed, exactly once: the client is shown a score only for a row its
    # report counts scored.
    [watch] = open_outcome.finished.bindings
    assert (watch.rows_scored, watch.rows_unprobed) == (scored, unprobed)
    assert scored + unprobed == long - 1

    # The router comes back on the same port: new requests are probed again, no engine restart.
    await start_router(0, tmp_path / "probes-0")
    await stack.wait_for_probe(engine, WATCH)
    again = await stack.generate(engine, request("after-restart", types_pb.FAILURE_POLICY_FAIL_CLOSED, 8))
    assert again.reason == "LENGTH" and again.finished.unprobed_tokens == 0
    assert sum(len(e.token_positions) for e in again.scores) == 7


async def test_a_dead_routers_probes_leave_the_catalog(engine, start_router, tmp_path):
    write_watch_probe(tmp_path / "probes-0")
    router = await start_router(0, tmp_path / "probes-0")
    await stack.wait_for_probe(engine, WATCH)
    router.kill()
    await asyncio.sleep(0.5)
    # The catalog forgets a dead router's probes: binding it is now NOT_FOUND.
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stack.generate(engine, request("orphan", types_pb.FAILURE_POLICY_FAIL_CLOSED, 4))
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'watch_norm' is not loaded in any reachable router" in failure.value.details()



async def test_request_of_a_lost_replica_is_rehomed_and_finishes(
        engine_service, engine, engine_metrics_port, two_routers):
    rehomed_before = stack.scrape(engine_metrics_port).get(REHOMED, 0.0)
    progress = stack.Outcome()
    # vLLM runs in short bursts until the first score, then holds while the home
    # replica is lost and the engine sees it: unpaced, the tiny model decoded the
    # whole request before a loaded client saw its first score.
    with stack.vllm_paused(engine_service) as vllm:
        running = asyncio.create_task(stack.generate(
            engine, request("rehomed", types_pb.FAILURE_POLICY_FAIL_OPEN, 1000), outcome=progress))
        async with asyncio.timeout(120):
            while not progress.scores:
                await vllm.run_for(0.02)
                await asyncio.sleep(0.1)
        home = progress.scores[0].router
        assert not running.done(), "the request ended before its replica was lost"
        next(r for r in two_routers if r.address == home).kill()
        await stack.wait_metric(engine_metrics_port, REPLICAS_UP, lambda up: up == 1.0)
    outcome = await running
    assert stack.scrape(engine_metrics_port).get(REHOMED, 0.0) == rehomed_before + 1
    # It finishes on the surviving replica; rows the lost one had not acknowledged
    # are counted (fail_open), never silently taken as scored.
    assert outcome.reason == "LENGTH", outcome.finished
    scored_positions = sum(len(e.token_positions) for e in outcome.scores)
    unprobed = outcome.finished.unprobed_tokens
    [watch] = outcome.finished.bindings
    assert (watch.rows_scored, watch.rows_unprobed) == (scored_positions, unprobed)
    assert scored_positions + unprobed == 999 and unprobed < 999
    routers = [event.router for event in outcome.scores]
    survivor = next(r.address for r in two_routers if r.address != home)
    assert routers[0] == home and routers[-1] == survivor
    assert routers == sorted(routers, key=lambda r: r != home), "it moved once, and for good"
    positions = [p for event in outcome.scores for p in event.token_positions]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
