"""RouterLink faults against real grpc.aio router doubles: each one leaves the
rows it concerns unscored in the request's ledger, and nothing else."""

from __future__ import annotations

import gc
import time
import weakref

from google.rpc import code_pb2
from undercurrent.v1 import router_session_pb2 as session_pb

from engine_service.link import Abort, Processed, Scores, Unscored
from tools.router_double import abort_reply, scores_reply

from .helpers import FAIL_CLOSED, start, step, until


def metric(link, name: str, **labels) -> float:
    return link.registry.get_sample_value(f"undercurrent_router_link_{name}", labels) or 0.0


async def test_the_ack_of_the_first_part_of_a_split_step_settles_no_row_of_a_later_part(routers, links):
    router = await routers()
    link, events = links(router.address, max_message_bytes=16_000)
    await link.start()
    await link.wait_ready(timeout=10)
    ledger = start(link, "big", FAIL_CLOSED, prompt_tokens=100, layers=(0, 1))
    # One step, two layers, every position in both: too big for one message, so
    # layer 0 and layer 1 of the same positions travel in different parts.
    router.withhold_ack = lambda step: step > 1
    link.send_step([step({"big": list(range(60))}, layer=0, hidden=64),
                    step({"big": list(range(60))}, layer=1, hidden=64)])
    ledger.computed_below(60)
    await router.wait_for(lambda: len(router.batches) >= 2 and router.withheld)
    await events.wait_for(lambda: events.of(Processed, "big"))
    first = router.batches[0]
    assert {b.layer for b in first.blocks} == {0}  # part 0 holds layer 0 only
    # Its ack settled layer-0 rows, yet no position: every one has a layer-1 row in flight.
    assert ledger.releasable_through() == -1 and ledger.first_unscored() == 0
    assert ledger.in_flight() > 0
    router.release_acks()
    await until(lambda: ledger.in_flight() == 0)
    assert (ledger.releasable_through(), ledger.unprobed_tokens()) == (59, 0)


async def test_a_batch_error_naming_only_its_step_concerns_every_request_in_it(routers, links):
    router = await routers()
    link, events = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    ledgers = {r: start(link, r, FAIL_CLOSED) for r in ("a", "b", "c")}
    router.fail_steps = {2}
    link.send_step([step({"a": [0], "b": [0], "c": [0]})])
    link.send_step([step({"a": [1], "b": [1]})])  # step 2: a and b only
    link.send_step([step({"a": [2], "b": [2], "c": [1]})])
    for r, computed in zip("abc", (3, 3, 2)):
        ledgers[r].computed_below(computed)
    await until(lambda: all(ledger.in_flight() == 0 for ledger in ledgers.values()))
    assert sorted(e.request_id for e in events.of(Unscored)) == ["a", "b"]
    assert all(
        e.failure.fail_closed and "INTERNAL: scoring the batch failed" in e.failure.reason
        for e in events.of(Unscored)
    )
    assert [ledgers[r].first_unscored() for r in "abc"] == [1, 1, 2]
    assert [ledgers[r].releasable_through() for r in "abc"] == [0, 0, 1]
    assert [ledgers[r].unprobed_tokens() for r in "abc"] == [1, 1, 0]
    assert metric(link, "router_errors_total", code="INTERNAL") == 1
    assert metric(link, "unscored_records_total", reason="router_error") == 2


async def test_an_error_code_this_engine_does_not_know_still_fails_the_run_it_names(routers, links):
    """A newer router may send a google.rpc.Code value this build lacks: it is
    counted and reported by its number, and the run's rows are unscored."""
    router = await routers()
    link, events = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    start(link, "r", FAIL_CLOSED)
    await router.wait_for(lambda: "r" in router.incarnations)
    router.push(session_pb.SessionResponse(error=session_pb.RequestError(
        request_id="r", incarnation=router.incarnations["r"], code=99, message="a newer kind of problem")))
    await events.wait_for(lambda: events.of(Unscored, "r"))
    [unscored] = events.of(Unscored, "r")
    assert unscored.failure.fail_closed and unscored.failure.reason.endswith(": 99: a newer kind of problem")
    assert metric(link, "router_errors_total", code="99") == 1


async def test_rows_left_unacknowledged_past_the_router_timeout_expire_while_the_replica_stays_up(
    routers, links
):
    router = await routers()
    link, events = links(router.address, router_timeout_s=0.3, heartbeat_timeout_s=5.0)
    await link.start()
    await link.wait_ready(timeout=10)
    ledger = start(link, "r", FAIL_CLOSED)
    link.send_step([step({"r": [0]})])
    await events.wait_for(lambda: events.of(Processed, "r"))
    router.silent = True
    sent = time.monotonic()
    link.send_step([step({"r": [1]})])
    ledger.computed_below(2)
    await events.wait_for(lambda: events.of(Unscored, "r"), timeout=5)
    waited = time.monotonic() - sent
    assert 0.3 <= waited < 0.3 + 0.5
    [expired] = events.of(Unscored, "r")
    assert expired.failure.fail_closed and "acknowledged no rows for 0.3 s" in expired.failure.reason
    assert (ledger.releasable_through(), ledger.first_unscored()) == (0, 1)
    assert link.replicas_up() == [router.address]  # the heartbeat timeout is still far


async def test_messages_from_a_replica_that_does_not_own_the_request_are_ignored(routers, links):
    a, b = await routers(), await routers()
    link, events = links(f"{a.address},{b.address}")
    await link.start()
    await link.wait_ready(2, timeout=10)
    ids = [f"req-{i}" for i in range(16)]
    for request_id in ids:
        start(link, request_id)
    on_a = next(r for r in ids if link.replica_of(r) == a.address)
    await a.wait_for(lambda: on_a in a.incarnations)
    incarnation = a.incarnations[on_a]
    # b never got this request: its verdict and scores about it are not trusted.
    b.push(abort_reply(on_a, incarnation))
    b.push(scores_reply(on_a, incarnation))
    b.push(session_pb.SessionResponse(error=session_pb.RequestError(request_id=on_a, incarnation=incarnation,
                                                    code=code_pb2.INTERNAL)))
    await until(lambda: metric(link, "ignored_messages_total", reason="not_its_replica") == 3)
    # From its owner, the same verdict counts.
    a.push(abort_reply(on_a, incarnation))
    await events.wait_for(lambda: events.of(Abort, on_a))
    assert [e.replica for e in events.of(Abort)] == [a.address]
    assert events.of(Scores, on_a) == [] and events.of(Unscored, on_a) == []


async def test_a_router_message_without_the_runs_incarnation_is_not_trusted(routers, links):
    router = await routers()
    link, events = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    start(link, "r")
    # Its first message, before any echoed one: still not about the live run.
    router.push(abort_reply("r", 0))
    await until(lambda: metric(link, "ignored_messages_total", reason="stale_incarnation") == 1)
    assert events.of(Abort) == []


async def test_a_router_that_reads_every_batch_but_acks_none_does_not_keep_their_rows_in_the_engine(
    routers, links
):
    """Written batches wait in the step ledger for their acks, and their rows must
    not wait with them: a router that reads everything and acknowledges nothing
    would otherwise make the engine hold every row it ever sent, past the send
    queue's bounds (HTTP/2 flow control never pushes back, as the router reads)."""
    router = await routers()
    router.withhold_ack = lambda step: True
    link, events = links(router.address, router_timeout_s=30.0)
    await link.start()
    await link.wait_ready(timeout=10)
    ledger = start(link, "r", FAIL_CLOSED, prompt_tokens=4, layers=(0, 1))
    blocks = [step({"r": list(range(4))}, layer=layer, hidden=4096) for layer in (0, 1)]
    sent_rows = [weakref.ref(block.rows) for block in blocks]
    link.send_step(blocks)
    ledger.computed_below(4)
    del blocks
    await router.wait_for(lambda: router.withheld == [1])
    gc.collect()
    assert [ref() is None for ref in sent_rows] == [True, True], "the engine still holds rows it sent"
    # The batch's ledger entries stay: its ack, when it comes, settles its rows.
    assert ledger.in_flight() > 0
    router.release_acks()
    await events.wait_for(lambda: events.of(Processed, "r"))
    await until(lambda: ledger.in_flight() == 0)
    assert (ledger.releasable_through(), ledger.unprobed_tokens()) == (3, 0)
