"""Workers' pushes to the engine service: order, sequence barrier, timeouts (real
ZeroMQ sockets, no vLLM)."""

import time

import numpy as np

from common.activations import Block, decode_part, encode_part
from engine_service.capture.push import Pusher, Sink
from undercurrent.v1 import undercurrent_pb2 as pb


def shipment(rank: int, position: int) -> dict:
    block = Block("p", pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, np.full((1, 4), position, np.float32), ["r"],
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
    from engine_service.capture.push import NODE_IDENTITY_ENV

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
