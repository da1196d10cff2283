"""RouterLink against real grpc.aio router doubles on loopback."""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
import prometheus_client
import pytest
import zmq
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.activations import Block, decode_parts, encode_part
from engine_service.capture.channel import shipment_frames, shipment_from_frames
from engine_service.link import (
    Abort,
    Processed,
    RouterLink,
    RouterLinkConfig,
    Scores,
    Unavailable,
    Unscored,
)
from engine_service.link import batching
from engine_service.link.assignment import pick_replica
from engine_service.link.send_queue import QueuedBatch

from .helpers import FAIL_CLOSED, FAST, HIDDEN, MODEL, start, step, until
from tools.router_double import PROBE


def rehomed_to(router, request_ids) -> bool:
    """Every one of these requests reached `router` by a re-home (request_start with state_reset)."""
    return all(r in router.requests and any(s.state_reset for s in router.requests[r].starts) for r in request_ids)


def loaded(link: RouterLink) -> list[str]:
    """The probes new requests can bind: those of the replicas that take requests."""
    return sorted({name for catalog in link.catalogs().values() for name in catalog})


def rehome_reasons(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if " re-homed to " in r.getMessage()]


def metric(link: RouterLink, name: str, **labels) -> float:
    return link.registry.get_sample_value(f"undercurrent_router_link_{name}", labels) or 0.0


async def test_two_replicas_split_requests_and_each_request_stays_on_one(routers, links):
    a, b = await routers(), await routers()
    link, events = links(f"{a.address},{b.address}")
    await link.start()
    await link.wait_ready(2, timeout=10)
    ids = [f"req-{i}" for i in range(32)]
    ledgers = {r: start(link, r, prompt_tokens=2) for r in ids}
    owners = {r: link.replica_of(r) for r in ids}
    assert owners == {r: pick_replica(r, [a.address, b.address]) for r in ids}
    assert set(owners.values()) == {a.address, b.address}
    for position in range(4):
        link.send_step(
            [
                step({r: [position] for r in ids}, layer=0),
                step({r: [position] for r in ids}, layer=1),
            ]
        )
    for ledger in ledgers.values():
        ledger.computed_below(4)
    for request_id in ids:
        link.end_request(request_id, types_pb.FINISH_REASON_STOP)
    for router in (a, b):
        mine = [r for r in ids if owners[r] == router.address]
        await router.wait_for(
            lambda: all(router.requests.get(r) and router.requests[r].ended for r in mine)
        )
        # One batch per engine step and replica, numbered per session.
        assert [batch.step for batch in router.batches] == [1, 2, 3, 4]
        assert set(router.requests) == set(mine)
        for request_id in mine:
            assert router.requests[request_id].positions == [0, 0, 1, 1, 2, 2, 3, 3]
            kinds = [k for k, r in router.log if r == request_id]
            assert kinds == ["start", "batch", "batch", "batch", "batch", "end"]
    # Acks that arrive after request_end still settle the ledger (no event: the run is over).
    await until(lambda: all(ledger.releasable_through() == 3 for ledger in ledgers.values()))
    assert all(ledger.in_flight() == 0 for ledger in ledgers.values())
    assert metric(link, "batches_sent_total", replica=a.address) == 4
    assert metric(link, "replicas_up") == 2
    assert all(e.replica == owners[e.request_id] for e in events.of(Scores))


@pytest.mark.parametrize("replies_as_one", [True, False], ids=["replies-as-one", "one-by-one"])
async def test_acks_settle_ledger_positions_and_verdicts_reach_their_request(routers, links, replies_as_one):
    router = await routers(threshold=1.0, replies_as_one=replies_as_one)
    link, events = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    assert router.hellos[0].accepts_replies
    calm = start(link, "calm", prompt_tokens=2)
    hot = start(link, "hot", prompt_tokens=2)
    link.send_step([step({"calm": [0, 1], "hot": [0, 1]}, first={"hot": 0.5})])
    link.send_step([step({"calm": [2], "hot": [2]}, first={"hot": 5.0})])
    calm.computed_below(3)
    hot.computed_below(3)
    await events.wait_for(lambda: len(events.of(Processed)) == 4)

    assert (calm.releasable_through(), hot.releasable_through()) == (2, 2)
    assert (calm.in_flight(), calm.unprobed_tokens(), calm.dropped_records) == (0, 0, 0)
    # Scores and verdicts carry the run's incarnation, as the router echoed it.
    assert {e.incarnation for e in events.of(Scores, "calm")} == {router.incarnations["calm"]}
    assert [list(e.scores.token_positions) for e in events.of(Scores, "calm")] == [[0, 1], [2]]
    assert events.of(Abort, "calm") == []
    [abort] = events.of(Abort, "hot")
    assert (abort.verdict.token_position, abort.verdict.score) == (2, 5.0)
    # The verdict of step 2 arrives before the ack that releases step 2's tokens.
    kinds = [type(e).__name__ for e in events.events if e.request_id == "hot"]
    assert kinds == ["Scores", "Processed", "Scores", "Abort", "Processed"]
    assert metric(link, "ack_latency_seconds_count") == 2


async def test_a_refused_request_start_leaves_the_stream_up_and_the_request_unscored(routers, links):
    router = await routers()
    link, events = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    bad = start(link, "bad", [types_pb.ProbeBinding(probe="missing", failure_policy=types_pb.FAILURE_POLICY_FAIL_CLOSED)])
    start(link, "good", prompt_tokens=1)
    link.send_step([step({"good": [0], "bad": [0]})])
    await events.wait_for(lambda: events.of(Processed, "good"))
    [refused] = events.of(Unscored, "bad")
    assert refused.failure.fail_closed
    assert f"router {router.address} error for probe 'missing': NOT_FOUND" in refused.failure.reason
    # Its rows were still sent (and acknowledged) but count as unscored.
    assert (bad.unprobed_tokens(), bad.first_unscored(), bad.releasable_through()) == (1, 0, -1)
    assert link.replicas_up() == [router.address]
    assert metric(link, "router_errors_total", code="NOT_FOUND") == 1


async def test_killed_replica_rehomes_its_requests_then_reconnects_on_the_same_port(routers, links):
    a, b = await routers(), await routers()
    link, events = links(f"{a.address},{b.address}")
    await link.start()
    await link.wait_ready(2, timeout=10)
    ids = [f"req-{i}" for i in range(32)]
    for request_id in ids:
        start(link, request_id, prompt_tokens=1, caller=f"caller-of-{request_id}")
    on_a = [r for r in ids if link.replica_of(r) == a.address]
    on_b = [r for r in ids if link.replica_of(r) == b.address]
    assert on_a and on_b
    link.send_step([step({r: [0] for r in ids})])
    await events.wait_for(lambda: len(events.of(Processed)) == len(ids))

    await a.kill()
    await b.wait_for(lambda: rehomed_to(b, on_a))
    assert metric(link, "rehomed_requests_total") == len(on_a)
    assert all(link.replica_of(r) == b.address for r in ids)

    link.send_step([step({r: [1] for r in ids})])
    await b.wait_for(
        lambda: all(r in b.requests and b.requests[r].positions[-1:] == [1] for r in ids)
    )
    assert all(b.requests[r].starts[-1].state_reset for r in on_a)
    assert not any(s.state_reset for r in on_b for s in b.requests[r].starts)
    assert all(b.requests[r].positions == [1] for r in on_a)  # step 0 of these went to a
    # Every request_start names the request's caller, the re-homed ones too (for the verdict log).
    assert all(s.caller == f"caller-of-{r}" for r in ids for s in b.requests[r].starts)

    a_again = await routers(port=a.port)
    await link.wait_ready(2, timeout=10)
    assert metric(link, "reconnects_total", replica=a.address) == 1
    assert all(link.replica_of(r) == b.address for r in ids)  # no reshuffle on return
    assert a_again.requests == {}
    fresh = [f"fresh-{i}" for i in range(32)]
    for request_id in fresh:
        start(link, request_id, prompt_tokens=1)
    assert {link.replica_of(r) for r in fresh} == {a.address, b.address}


async def test_dns_target_resolves_localhost(routers, links):
    router = await routers()
    link, events = links(f"dns:localhost:{router.port}")
    await link.start()
    await link.wait_ready(timeout=10)
    assert link.replicas_up() == [router.address]
    start(link, "r", prompt_tokens=1)
    link.send_step([step({"r": [0]})])
    await events.wait_for(lambda: events.of(Processed, "r"))
    assert router.hellos[0].engine_id == "engine-test"


async def test_dns_membership_changes_live(routers, links, caplog):
    a, b = await routers(), await routers()
    resolved = [a.address]
    failing = False
    calls = 0

    async def resolver(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        assert (host, port) == ("routers.test", 50051)
        if failing:
            raise OSError("resolver unreachable")
        return list(resolved)

    link, events = links("dns:routers.test:50051", resolver=resolver, dns_refresh_s=0.02)
    await link.start()
    await link.wait_ready(timeout=10)
    ids = [f"req-{i}" for i in range(10)]
    for request_id in ids:
        start(link, request_id, prompt_tokens=1)
    assert {link.replica_of(r) for r in ids} == {a.address}

    resolved.append(b.address)
    await link.wait_ready(2, timeout=10)
    assert {link.replica_of(r) for r in ids} == {a.address}  # a request keeps its replica

    failing = True  # a resolver outage keeps the replicas it knew
    calls_before = calls
    await until(lambda: calls >= calls_before + 2)
    assert link.replicas_up() == sorted([a.address, b.address])
    failing = False
    resolved.remove(a.address)
    await b.wait_for(lambda: rehomed_to(b, ids))
    assert link.replicas_up() == [b.address]
    assert {link.replica_of(r) for r in ids} == {b.address}
    assert len(rehome_reasons(caplog)) == len(ids)
    assert all("removed from DNS" in reason for reason in rehome_reasons(caplog))


def queued_batches(link: RouterLink, address: str) -> int:
    return link._replicas[address].queue.batches


@pytest.mark.parametrize(
    "policy, delivered", [("drop_oldest", [3, 4, 5]), ("drop_newest", [0, 1, 2])]
)
async def test_overflow_policies_count_drops_per_request_and_leave_them_unscored(
    routers, links, policy, delivered
):
    router = await routers()
    link, events = links(router.address, queue_max_batches=3, overflow_policy=policy)
    await link.start()
    await link.wait_ready(timeout=10)
    r1 = start(link, "r1", FAIL_CLOSED)
    r2 = start(link, "r2")
    # No await in between: the writer cannot run, so the queue fills exactly.
    queued_before = []
    for position in range(6):
        queued_before.append(queued_batches(link, router.address))
        link.send_step([step({"r1": [position], "r2": [position, position]}, layer=0)])
    assert queued_before == [0, 1, 2, 3, 3, 3]
    assert (r1.dropped_records, r2.dropped_records) == (3, 6)
    assert metric(link, "dropped_batches_total", reason=policy) == 3
    assert metric(link, "dropped_records_total", reason=policy) == 9
    # Each drop is an Unscored event: fail_closed for r1, fail_open for r2.
    assert [e.failure.fail_closed for e in events.of(Unscored, "r1")] == [True] * 3
    assert [e.failure.fail_closed for e in events.of(Unscored, "r2")] == [False] * 3
    assert all(policy in e.failure.reason for e in events.of(Unscored))

    r1.computed_below(6)
    r2.computed_below(6)
    await router.wait_for(lambda: len(router.batches) == 3)
    assert router.requests["r1"].positions == delivered
    assert router.requests["r2"].positions == [p for p in delivered for _ in range(2)]
    await events.wait_for(lambda: r1.in_flight() == 0 and r2.in_flight() == 0)
    assert (r1.unprobed_tokens(), r2.unprobed_tokens()) == (3, 3)
    dropped = sorted(set(range(6)) - set(delivered))
    assert r1.first_unscored() == dropped[0]
    # fail_open: the drops do not hold tokens back; fail_closed: they do.
    assert (r2.releasable_through(), r1.releasable_through()) == (5, dropped[0] - 1)


async def test_a_stalled_router_never_blocks_the_caller_and_every_loss_is_counted(routers, links):
    router = await routers()
    link, _ = links(router.address, queue_max_batches=4, heartbeat_timeout_s=5.0)
    await link.start()
    await link.wait_ready(timeout=10)
    ledger = start(link, "r", prompt_tokens=1)
    router.reading.clear()

    async def held_by_flow_control() -> bool:
        """Full and staying full: the writer is blocked, not merely late."""
        if queued_batches(link, router.address) < 4:
            return False
        await asyncio.sleep(0.05)
        return queued_batches(link, router.address) == 4

    slowest = 0.0
    steps = 0
    # Steps of 256 KiB until the transport's buffers are full and the queue is too.
    while not await held_by_flow_control():
        assert steps < 1000, "flow control never pushed back"
        began = time.monotonic()
        link.send_step([step({"r": [steps]}, hidden=65536)])
        slowest = max(slowest, time.monotonic() - began)
        steps += 1
        await asyncio.sleep(0.001)  # the writer runs until flow control stops it
    for position in range(steps, steps + 3):  # three more overflow the full queue
        link.send_step([step({"r": [position]}, hidden=65536)])
    assert slowest < 0.5  # CPU time only: a send that waited on the network would hang
    assert ledger.dropped_records == 3
    assert metric(link, "dropped_records_total", reason="drop_oldest") == 3

    await router.kill()
    await until(lambda: link.replicas_up() == [])
    # Every batch was either written or counted as dropped: the queued ones (and
    # one cut off mid-write) when the replica went down.
    sent = metric(link, "batches_sent_total", replica=router.address)
    lost = metric(link, "dropped_batches_total", reason="replica_down")
    assert lost >= 3
    assert sent + 3 + lost == steps + 3
    assert ledger.dropped_records == 3 + lost  # one row per batch
    # Every row is now dropped, lost unacknowledged with the replica, or (none here) acked.
    assert ledger.in_flight() == 0 and ledger.unprobed_tokens() == steps + 3


async def test_a_step_over_the_message_limit_is_split(routers, links):
    router = await routers()
    limit = 16_000
    link, events = links(router.address, max_message_bytes=limit)
    await link.start()
    await link.wait_ready(timeout=10)
    ledger = start(link, "big", prompt_tokens=100)
    block = step({"big": list(range(100))}, hidden=64)  # ~26 KB of rows
    link.send_step([block])
    ledger.computed_below(100)
    await events.wait_for(lambda: ledger.releasable_through() == 99)
    assert len(router.batches) >= 2
    assert [b.step for b in router.batches] == list(range(1, len(router.batches) + 1))
    assert all(session_pb.SessionRequest(batch=b).ByteSize() <= limit for b in router.batches)
    assert router.requests["big"].positions == list(range(100))


async def test_a_silent_replica_is_marked_down_by_the_heartbeat_timeout(routers, links, caplog):
    a, b = await routers(), await routers()
    link, events = links(f"{a.address},{b.address}", heartbeat_timeout_s=0.3)
    await link.start()
    await link.wait_ready(2, timeout=10)
    ids = [f"req-{i}" for i in range(32)]
    for request_id in ids:
        start(link, request_id, prompt_tokens=1)
    on_a = [r for r in ids if link.replica_of(r) == a.address]
    assert on_a
    a.silent = True  # the stream stays open; nothing comes back
    silenced = time.monotonic()
    await b.wait_for(lambda: rehomed_to(b, on_a), timeout=10)
    assert time.monotonic() - silenced >= 0.25
    assert link.replicas_up() == [b.address]
    assert len(rehome_reasons(caplog)) == len(on_a)
    assert all("no message" in reason for reason in rehome_reasons(caplog))


async def test_echoed_heartbeats_keep_a_quiet_replica_up(routers, links):
    router = await routers(heartbeat_s=60)  # sends nothing of its own
    link, _ = links(router.address, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)
    await link.start()
    await link.wait_ready(timeout=10)
    await router.wait_for(lambda: router.heartbeats >= 12)  # 1.2 s: twice the timeout
    assert link.replicas_up() == [router.address]
    assert len(router.hellos) == 1  # never reconnected


async def test_no_reachable_replica_drops_rows_and_signals_unavailability(routers, links):
    router = await routers()
    link, events = links(router.address, router_timeout_s=0.2)
    await link.start()
    await link.wait_ready(timeout=10)
    ledger = start(link, "r", prompt_tokens=1)
    link.send_step([step({"r": [0]})])
    await events.wait_for(lambda: events.of(Processed, "r"))

    await router.kill()
    await until(lambda: link.unavailable_since("r") is not None)
    lost_at = link.unavailable_since("r")
    for position in (1, 2):  # two layers per token: rows 4, tokens 2
        link.send_step([step({"r": [position]}, layer=0), step({"r": [position]}, layer=1)])
    assert (ledger.unprobed_tokens(), ledger.dropped_records) == (2, 4)
    assert metric(link, "dropped_records_total", reason="no_replica") == 4
    assert [e.failure.rows for e in events.of(Unscored, "r")] == [2, 2]
    await events.wait_for(lambda: events.of(Unavailable, "r"), timeout=10)
    [unavailable] = events.of(Unavailable, "r")
    assert unavailable.since == lost_at
    assert time.monotonic() - lost_at >= 0.2

    back = await routers(port=router.port)
    await back.wait_for(lambda: "r" in back.requests, timeout=10)
    assert [s.state_reset for s in back.requests["r"].starts] == [True]
    assert link.unavailable_since("r") is None
    assert len(events.of(Unavailable)) == 1
    link.send_step([step({"r": [3]})])
    await events.wait_for(lambda: ledger.in_flight() == 0)
    assert (ledger.unprobed_tokens(), ledger.dropped_records) == (2, 4)


async def test_a_request_started_before_any_replica_is_up_starts_clean(routers, links):
    router = await routers()
    link, events = links(router.address)
    start(link, "early", prompt_tokens=3)  # before start(): nothing is up
    assert link.unavailable_since("early") is not None
    await link.start()
    await link.wait_ready(timeout=10)
    await router.wait_for(lambda: "early" in router.requests)
    assert [s.state_reset for s in router.requests["early"].starts] == [False]
    assert metric(link, "rehomed_requests_total") == 0


async def test_drain_moves_requests_away_and_drops_its_probes_from_the_catalog(routers, links):
    only_a = types_pb.ProbeInfo(name="only_on_a", tensor_type=types_pb.TENSOR_TYPE_MLP_OUT, layers=[1])
    a = await routers(probes=[PROBE, only_a])
    b = await routers()
    link, events = links(f"{a.address},{b.address}")
    await link.start()
    await link.wait_ready(2, timeout=10)
    assert loaded(link) == ["first_element", "only_on_a"]
    ids = [f"req-{i}" for i in range(32)]
    for request_id in ids:
        start(link, request_id, prompt_tokens=1)
    on_a = [r for r in ids if link.replica_of(r) == a.address]
    assert on_a

    a.drain()
    await b.wait_for(lambda: rehomed_to(b, on_a))
    await a.wait_for(lambda: all(r in a.requests and a.requests[r].ended for r in on_a))
    await b.wait_for(lambda: all(r in b.requests for r in on_a))
    assert all(b.requests[r].starts[-1].state_reset for r in on_a)
    assert loaded(link) == ["first_element"]
    assert a.address in link.replicas_up()  # draining, not down
    for request_id in (f"new-{i}" for i in range(8)):
        start(link, request_id, prompt_tokens=1)
        assert link.replica_of(request_id) == b.address


async def test_a_lone_draining_replica_keeps_its_requests_until_another_is_up(routers, links):
    a, b = await routers(), await routers()
    resolved = [a.address]

    async def resolver(host: str, port: int) -> list[str]:
        return list(resolved)

    link, events = links("dns:routers.test:1", resolver=resolver, dns_refresh_s=0.02)
    await link.start()
    await link.wait_ready(timeout=10)
    start(link, "r", prompt_tokens=1)
    a.drain()
    await until(lambda: loaded(link) == [])
    assert link.replica_of("r") == a.address  # nowhere better: it stays
    link.send_step([step({"r": [0]})])
    await events.wait_for(lambda: events.of(Processed, "r"))
    start(link, "late", prompt_tokens=1)
    assert link.replica_of("late") is None  # a draining replica takes no new request
    assert link.unavailable_since("late") is not None

    resolved.append(b.address)
    await b.wait_for(lambda: rehomed_to(b, ["r"]))
    assert (link.replica_of("r"), link.replica_of("late")) == (b.address, b.address)
    await a.wait_for(lambda: a.requests["r"].ended)
    await b.wait_for(lambda: "late" in b.requests and "r" in b.requests)
    assert [s.state_reset for s in b.requests["late"].starts] == [False]  # it missed nothing


async def test_catalog_follows_router_pushes(routers, links):
    router = await routers()
    link, _ = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    assert loaded(link) == ["first_element"]
    router.set_probes([types_pb.ProbeInfo(name="second", tensor_type=types_pb.TENSOR_TYPE_ATTN_OUT, layers=[0, 1])])
    await until(lambda: loaded(link) == ["second"])
    assert list(link.catalogs()[router.address]["second"].layers) == [0, 1]


async def test_close_ends_streams_gracefully(routers, links):
    router = await routers()
    link, _ = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    start(link, "r", prompt_tokens=1)
    link.send_step([step({"r": [0]})])
    await link.close()
    assert router.half_closed == 1
    assert router.requests["r"].positions == [0]  # the queue was flushed first


def test_links_can_share_the_default_registry():
    config = RouterLinkConfig(targets="127.0.0.1:1", **FAST)
    first = RouterLink(config, MODEL, print, registry=prometheus_client.REGISTRY)
    second = RouterLink(config, MODEL, print, registry=prometheus_client.REGISTRY)
    assert first._metrics is second._metrics
    own = RouterLink(config, MODEL, print)
    assert own.registry is not prometheus_client.REGISTRY


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="host:port"):
        RouterLinkConfig(targets="nope")
    with pytest.raises(ValueError):
        RouterLinkConfig(targets="a:1", overflow_policy="drop_everything")
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        RouterLinkConfig(targets="a:1", heartbeat_interval_s=2, heartbeat_timeout_s=1)
    with pytest.raises(ValueError, match="router_timeout_s"):
        RouterLinkConfig(targets="a:1", router_timeout_s=0)
    with pytest.raises(ValueError):
        RouterLinkConfig(targets="a:1", overflow_policy="backpressure")


def received_step(rows: np.ndarray, request_id: str, layers: int) -> list[Block]:
    """One step's blocks as the engine service reads them: views of the frame a
    worker's push brought (`capture.channel`), one block per layer of `rows`."""
    per_layer = len(rows) // layers
    header, buffers = shipment_frames({"rank": 0, "parts": [
        encode_part(Block("probe.residual_stream.0", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer,
                          rows[layer * per_layer : (layer + 1) * per_layer], [request_id] * per_layer,
                          np.arange(per_layer), np.ones(per_layer, bool)), copy=False)
        for layer in range(layers)]})
    frames = [zmq.Frame(msgspec.msgpack.encode(header)), *(zmq.Frame(bytes(b)) for b in buffers)]
    return decode_parts(shipment_from_frames(frames)["parts"])


def kept_alive(piece: memoryview) -> int:
    """Bytes of the buffer a queued batch's piece keeps alive."""
    return memoryview(batching.buffer_kept_alive(np.frombuffer(piece, np.uint8))).nbytes


def row_pieces(link: RouterLink, address: str) -> list[memoryview]:
    batches = [i for i in link._replicas[address].queue.items if isinstance(i, QueuedBatch)]
    return [p for b in batches for p in b.batch_bytes.pieces if isinstance(p, memoryview)]


async def test_a_queued_batch_keeps_alive_no_more_than_twice_its_rows(routers, links):
    """A step's rows arrive as one buffer that also holds rows for clients: a
    router that does not read must not keep whole steps alive with each probe row
    its queue counts, or the queue's byte bound would not bound memory."""
    router = await routers()
    link, _ = links(router.address)
    await link.start()
    await link.wait_ready(timeout=10)
    start(link, "r", prompt_tokens=1)
    rows = np.random.default_rng(0).normal(size=(10, HIDDEN)).astype(np.float32)
    probe_block, *client_blocks = received_step(rows, "r", layers=10)
    # No await in between: the writer cannot run, so the batches stay queued.
    link.send_step([probe_block])  # the other nine layers went to a client
    (piece,) = row_pieces(link, router.address)
    assert bytes(piece) == rows[0].tobytes()
    assert kept_alive(piece) == piece.nbytes  # its own copy (the frame: 10 times as much)
    link.send_step([probe_block, *client_blocks])  # a router reading every layer: no copy
    pieces = row_pieces(link, router.address)[1:]
    assert [bytes(p) for p in pieces] == [r.tobytes() for r in rows]
    assert [kept_alive(p) for p in pieces] == [rows.nbytes] * 10  # views of the one frame
