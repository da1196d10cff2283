"""Workers' pushes to the engine service: order, sequence barrier, timeouts (real
ZeroMQ sockets, no vLLM)."""

import asyncio
import time

import msgspec
import numpy as np
import pytest
import zmq

from common.activations import Block, decode_part, encode_part
from engine_service.capture.worker.pusher import Pusher
from engine_service.capture.channel import ShipmentError, shipment_frames, shipment_from_frames
from engine_service.capture.driver.sink import Sink
from undercurrent.v1 import types_pb2 as types_pb


def shipment(rank: int, position: int) -> dict:
    block = Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, np.full((1, 4), position, np.float32), ["r"],
                  np.array([position]), np.array([True]))
    return {"rank": rank, "parts": [encode_part(block)], "gaps": [], "errors": []}


async def test_pushes_arrive_in_order_and_the_barrier_waits_for_the_last_one():
    sink = Sink()
    pushers = [Pusher(sink.address.as_dict(), rank) for rank in (0, 1)]
    try:
        assert await sink.receive(0.01) == []
        for position in range(3):
            pushers[0].push(shipment(0, position))
        pushers[1].push(shipment(1, 9))
        barrier = {0: pushers[0].seq, 1: pushers[1].seq}
        assert barrier == {0: 3, 1: 1}
        got = await sink.receive_until(barrier, timeout_s=10)
        assert sink.reached(barrier)
        by_rank = {0: [], 1: []}
        for s in got:
            by_rank[s["rank"]].append(int(decode_part(s["parts"][0]).token_positions[0]))
        assert by_rank == {0: [0, 1, 2], 1: [9]}
        assert [s["seq"] for s in got if s["rank"] == 0] == [1, 2, 3]
    finally:
        sink.close()


async def test_a_barrier_never_reached_gives_up_after_its_timeout():
    sink = Sink()
    try:
        start = time.monotonic()
        assert await sink.receive_until({0: 1}, timeout_s=0.2) == []
        assert 0.2 <= time.monotonic() - start < 5
        assert not sink.reached({0: 1})
    finally:
        sink.close()


async def test_a_wait_for_shipments_ends_when_woken_or_when_one_arrives():
    """drain() waits long for rows; a register or unregister (the wake event)
    must end the wait at once, and so must a shipment."""
    sink = Sink()
    pusher = Pusher(sink.address.as_dict(), 0)
    wake = asyncio.Event()
    try:
        waiting = asyncio.create_task(sink.receive(60, wake=wake))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        wake.set()
        assert await asyncio.wait_for(waiting, 10) == []
        wake.clear()
        waiting = asyncio.create_task(sink.receive(60, wake=wake))
        await asyncio.sleep(0.05)
        pusher.push(shipment(0, 7))
        [got] = await asyncio.wait_for(waiting, 10)
        assert int(decode_part(got["parts"][0]).token_positions[0]) == 7
        assert not wake.is_set()
    finally:
        pusher.close()
        sink.close()


def test_the_sink_is_private_to_this_user_and_this_host():
    sink = Sink()
    try:
        path = sink.address.endpoint.removeprefix("ipc://")
        import os
        import stat

        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert Pusher.reaches(sink.address.as_dict())
        assert not Pusher.reaches({**sink.address.as_dict(), "host": "another-node"})
    finally:
        sink.close()


def test_a_declared_node_identity_keeps_a_process_off_another_nodes_sink(monkeypatch):
    """Worker nodes declare an identity of their own: even on the engine's host,
    their workers do not push (a shared hostname need not mean a shared /tmp)."""
    from engine_service.capture.channel import NODE_IDENTITY_ENV

    sink = Sink()
    try:
        monkeypatch.setenv(NODE_IDENTITY_ENV, "host-a/node-1")
        assert not Pusher.reaches(sink.address.as_dict())
        other = Sink()
        try:
            assert other.address.host == "host-a/node-1"
            assert Pusher.reaches(other.address.as_dict())
        finally:
            other.close()
    finally:
        sink.close()


def row_shipment(rank: int, request_id: str, position: int, traced: bool = True) -> dict:
    """One row of 4 float32 (16 bytes); traced: with an error and a prefix-cache gap,
    so a dropped shipment's rows, errors and gaps can all be followed."""
    block = Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, np.full((1, 4), position, np.float32), [request_id],
                  np.array([position]), np.array([True]))
    return {"rank": rank, "parts": [encode_part(block)],
            "gaps": [(request_id, "p", position, position + 1)] if traced else [],
            "errors": [f"error {position}"] if traced else []}


async def read_until_reached(sink: Sink, pusher: Pusher, timeout_s: float = 20) -> list[dict]:
    """The driver reading again: takes what arrived, lets the worker offer what it kept."""
    got, deadline = [], time.monotonic() + timeout_s
    while not sink.reached({pusher.rank: pusher.seq}) and time.monotonic() < deadline:
        got += await sink.receive(0.05)
        pusher.flush()
    return got


async def test_a_worker_whose_driver_does_not_read_keeps_its_backlog_bound_and_reports_every_dropped_row(caplog):
    from collections import Counter

    bound = 4 * 16  # four one-row shipments
    sink = Sink(backlog_bytes=bound)
    pusher = Pusher(sink.address.as_dict(), 0)
    pushed = Counter()
    try:
        # What ZeroMQ holds counts: its own queues would take about two thousand
        # shipments, so the first drop would come only after those.
        for position in range(3000):
            request_id = f"r{position % 3}"
            pusher.push(row_shipment(0, request_id, position))
            pushed[request_id] += 1
            # The bound holds at every push (plus the newest shipment, which is never dropped).
            assert pusher.held_bytes <= bound + 16
            if position == 5:
                assert pusher.dropped_rows == 1, "ZeroMQ's queue was not counted against the bound"
        keeping = [r for r in caplog.records if "keeps its shipments" in r.getMessage()]
        assert len(keeping) == 1, "the worker should say once, not at every step, that it keeps shipments"
        got = await read_until_reached(sink, pusher)
        assert sink.reached({0: pusher.seq})
        received = Counter(r for s in got for p in s["parts"] for r in p["request_ids"])
        reported = Counter()
        for s in got:
            for request_id, point, positions in s.get("dropped", ()):
                assert point == "p"  # reported per point, so the engine tells probe rows from a client's
                reported[request_id] += len(positions)
        # Every row either arrived or was reported dropped, for its own request; none twice.
        assert received + reported == pushed
        assert sum(reported.values()) == pusher.dropped_rows
        assert set(reported) == {"r0", "r1", "r2"}
        # Errors and gaps of dropped shipments arrive with a later one: none is lost.
        assert sorted(e for s in got for e in s["errors"]) == sorted(f"error {p}" for p in range(3000))
        assert len([g for s in got for g in s["gaps"]]) == 3000
    finally:
        pusher.close()
        sink.close()


async def test_the_driver_fails_each_request_whose_rows_a_worker_dropped():
    from engine_service.capture.driver.controller import CaptureController

    controller = CaptureController(engine=None, backlog_bytes=16)
    controller._sink = sink = Sink(backlog_bytes=16)  # what start() makes, without an engine
    controller._rpc_drained = False
    controller._registered = {"kept", "lost"}
    pusher = Pusher(sink.address.as_dict(), 0)
    try:
        position = 0
        while pusher.dropped_rows == 0:
            pusher.push(row_shipment(0, "lost", position, traced=False))
            position += 1
            assert position < 100_000, "the sink never stopped taking shipments"
        pusher.push(row_shipment(0, "kept", position, traced=False))
        blocks = []
        while not sink.reached({0: pusher.seq}):
            blocks += await controller.drain()
            pusher.flush()
        errors = controller.pop_request_errors()
        assert set(errors) == {"lost"}
        assert errors["lost"].startswith(f"capture: rank 0 dropped {pusher.dropped_rows} rows of this request")
        assert "--capture-backlog-bytes" in errors["lost"]
        assert controller.backlog_rows_dropped == pusher.dropped_rows
        [(key, positions)] = controller.pop_dropped_rows().items()  # what its finish counts, by position
        assert key == ("lost", "p") and len(positions) == len(set(positions)) == pusher.dropped_rows
        assert sum(b.num_rows for b in blocks) == position + 1 - pusher.dropped_rows
    finally:
        pusher.close()
        sink.close()


async def test_a_barrier_gets_every_kept_shipment_though_zeromq_holds_the_bound():
    """unregister's barrier waits for a worker's last shipment: pushed_seq's flush
    hands ZeroMQ what the worker kept even when ZeroMQ already holds the bound,
    and those bytes still count, so the next pushes keep and drop instead."""
    bound = 2 * 16
    sink = Sink(backlog_bytes=bound)
    pusher = Pusher(sink.address.as_dict(), 0)
    try:
        for position in range(3):
            pusher.push(row_shipment(0, "r", position, traced=False))
        assert (pusher.held_bytes, pusher.unsent_bytes) == (48, 16)  # two in ZeroMQ, one kept
        pusher.flush()
        assert pusher.unsent_bytes == 16  # a plain flush respects the bound
        pusher.flush(for_barrier=True)
        assert (pusher.held_bytes, pusher.unsent_bytes) == (48, 0)
        got = await sink.receive_until({0: pusher.seq}, timeout_s=10)
        assert [s["seq"] for s in got] == [1, 2, 3] and pusher.dropped_rows == 0
        assert pusher.held_bytes == 0  # the driver's reads reached the worker
        for position in range(3, 6):  # the driver reads again: nothing is kept or dropped
            pusher.push(row_shipment(0, "r", position, traced=False))
            await sink.receive_until({0: pusher.seq}, timeout_s=10)
        assert pusher.held_bytes == 0 and pusher.dropped_rows == 0
    finally:
        pusher.close()
        sink.close()


async def test_a_new_pusher_goes_on_from_the_last_ones_sequence():
    """Switching a worker from push to the RPC drain and back makes a new pusher;
    starting again from 1 would make the driver's barrier (the highest sequence
    read from the rank) count as reached before the new shipments arrived."""
    sink = Sink()
    first = Pusher(sink.address.as_dict(), 0)
    try:
        for position in range(3):
            first.push(shipment(0, position))
        await sink.receive_until({0: 3}, timeout_s=10)
    finally:
        first.close()
    second = Pusher(sink.address.as_dict(), 0, first_seq=first.seq)
    try:
        assert not sink.reached({0: first.seq + 1})
        second.push(shipment(0, 9))
        assert second.seq == 4
        [got] = await sink.receive_until({0: second.seq}, timeout_s=10)
        assert got["seq"] == 4 and sink.reached({0: 4})
        assert second.held_bytes == 0  # the driver's read progress applies to the new pusher too
    finally:
        second.close()
        sink.close()


def step_parts(step_rows: np.ndarray, per_part: int) -> list[dict]:
    """The parts of one step as a worker drains them: views of its staging buffer."""
    return [
        encode_part(Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer, step_rows[start : start + per_part],
                          [f"r{i}" for i in range(per_part)], np.arange(per_part), np.ones(per_part, bool)),
                    copy=False)
        for layer, start in enumerate(range(0, len(step_rows), per_part))
    ]


def test_a_steps_rows_go_as_its_one_buffer_without_a_copy():
    step_rows = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    header, buffers = shipment_frames({"rank": 0, "parts": step_parts(step_rows, 2)})
    assert len(buffers) == 1 and buffers[0].nbytes == step_rows.nbytes
    assert np.shares_memory(np.frombuffer(buffers[0], np.uint8), step_rows)
    assert [p["rows"] for p in header["parts"]] == [[1, 0, 32], [1, 32, 64], [1, 64, 96]]


def test_rows_that_view_no_one_buffer_go_as_frames_of_their_own():
    strided = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)[::2]  # pack_view copies it
    parts = [{"rows": b"abcd"}, {"rows": b""}, encode_part(Block(
        "p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, strided, ["r"] * 4, np.arange(4), np.ones(4, bool)), copy=False)]
    header, buffers = shipment_frames({"rank": 0, "parts": parts})
    assert [p["rows"] for p in header["parts"]] == [[1, 0, 4], [2, 0, 0], [3, 0, 64]]
    assert [bytes(b) for b in buffers[:2]] == [b"abcd", b""]
    received = shipment_from_frames([msgspec.msgpack.encode(header), *buffers])
    np.testing.assert_array_equal(decode_part(received["parts"][2]).rows, strided)


async def test_the_driver_reads_the_rows_in_place_in_the_frames_it_received():
    sink = Sink()
    pusher = Pusher(sink.address.as_dict(), 0)
    step_rows = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    try:
        pusher.push({"rank": 0, "parts": step_parts(step_rows, 2), "gaps": [], "errors": []})
        assert pusher.held_bytes == step_rows.nbytes  # the step's buffer, until the driver reads it
        (got,) = await sink.receive_until({0: 1}, timeout_s=10)
        blocks = [decode_part(p) for p in got["parts"]]
        np.testing.assert_array_equal(np.concatenate([b.rows for b in blocks]), step_rows)
        assert [b.layer for b in blocks] == [0, 1, 2]
        assert all(isinstance(p["rows"].obj, zmq.Frame) and p["rows"].readonly for p in got["parts"])
    finally:
        pusher.close()
        sink.close()


def test_a_shipment_whose_rows_point_outside_its_frames_is_refused_by_name():
    header = {"rank": 3, "seq": 7, "parts": [{"rows": [1, 0, 4]}, {"rows": [1, 2, 9]}]}
    with pytest.raises(ShipmentError, match=r"rank 3 seq 7: parts\[1\]\.rows \[1, 2, 9\] is outside the 1 buffers"):
        shipment_from_frames([msgspec.msgpack.encode(header), b"abcd"])
    header["parts"] = [{"rows": [0, 0, 1]}]  # frame 0 is the header itself
    with pytest.raises(ShipmentError, match=r"parts\[0\]\.rows \[0, 0, 1\]"):
        shipment_from_frames([msgspec.msgpack.encode(header), b"abcd"])
