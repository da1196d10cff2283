"""Driver-side merge: union, TP dedup, exactly once across drains, forward order."""

import dataclasses

import numpy as np
import pytest

from common.activations import Block, decode_parts, encode_part, forward_order
from engine_service.capture.driver.merge import (
    DeliveredPositions,
    ForwardOrderGate,
    ShapeMismatch,
    merge_blocks,
)
from undercurrent.v1 import types_pb2 as types_pb


def block(point, layer, keys, hidden=2, offset=0.0):
    """Rows whose values encode (position, layer) so tests can see which copy survived."""
    request_ids = [k[0] for k in keys]
    positions = np.array([k[1] for k in keys], dtype=np.int64)
    rows = np.stack([np.full(hidden, p * 10 + layer + offset, dtype=np.float32) for p in positions])
    return Block(point, types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer, rows, request_ids, positions, positions >= 3)


def keys_of(b: Block):
    return list(zip(b.request_ids, b.token_positions.tolist()))


def test_tp_duplicates_are_dropped_and_rows_grouped_by_request_in_first_seen_order_then_position():
    rank0 = block("p", 1, [("b", 1), ("a", 4), ("a", 3)])
    rank1 = block("p", 1, [("a", 3), ("b", 1), ("a", 4)], offset=0.5)  # same keys, another rank
    (merged,) = merge_blocks([rank0, rank1])
    assert keys_of(merged) == [("b", 1), ("a", 3), ("a", 4)]
    assert merged.rows[:, 0].tolist() == [11.0, 31.0, 41.0]  # first copy kept
    assert merged.is_generated.tolist() == [False, True, True]


def test_one_workers_rows_in_batch_order_are_kept_as_shipped_whatever_the_ids():
    """A worker ships a step's rows in its batch order, which is seldom the order of
    the requests' ids (client ids, "req-10" before "req-9"): kept, not copied."""
    part = block("p", 0, [("req-9", 20), ("req-10", 14), ("req-10", 15), ("0_req-2", 3)])
    (merged,) = merge_blocks([part])
    assert merged is part


def test_a_request_whose_rows_are_apart_is_brought_together_in_first_seen_order():
    (merged,) = merge_blocks([block("p", 0, [("b", 5), ("a", 2), ("b", 6), ("c", 1), ("a", 1)])])
    assert keys_of(merged) == [("b", 5), ("b", 6), ("a", 1), ("a", 2), ("c", 1)]
    assert merged.rows[:, 0].tolist() == [50.0, 60.0, 10.0, 20.0, 10.0]


def test_blocks_that_shared_keys_share_the_merged_keys():
    """Merging a step's blocks that share key objects (decode_parts) orders their
    keys once: the merged blocks share them too, for the per-key-set work after."""
    keys = [("b", 1), ("a", 1), ("b", 0)]  # "b" out of position order: not kept as shipped
    decoded = decode_parts([encode_part(block("p", layer, keys)) for layer in (0, 1, 2)])
    merged = merge_blocks(decoded)
    assert [keys_of(b) for b in merged] == [[("b", 0), ("b", 1), ("a", 1)]] * 3
    assert all(b.request_ids is merged[0].request_ids for b in merged)
    assert all(b.token_positions is merged[0].token_positions for b in merged)
    assert [b.rows[:, 0].tolist() for b in merged] == [[0.0, 10.0, 10.0], [1.0, 11.0, 11.0], [2.0, 12.0, 12.0]]


def test_disjoint_layers_arriving_interleaved_come_out_in_forward_order():
    """A point on layers 0..3, split over two pipeline stages, drained while the
    stages had processed different steps: stage 1 ships layers 2 and 3 for
    positions 0..1 after stage 0 already shipped layers 0 and 1 for 0..2."""
    arrivals = [
        block("p", 1, [("r", 2), ("r", 0), ("r", 1)]),  # stage 0, layer 1
        block("p", 3, [("r", 1), ("r", 0)]),  # stage 1, layer 3
        block("p", 0, [("r", 1), ("r", 2), ("r", 0)]),  # stage 0, layer 0
        block("p", 2, [("r", 0), ("r", 1)]),  # stage 1, layer 2
        block("q", 0, [("r", 0)]),
    ]
    merged = merge_blocks(arrivals)
    assert [(b.point, b.layer) for b in merged] == [("p", 0), ("p", 1), ("p", 2), ("p", 3), ("q", 0)]
    order = [(r.token_position, r.layer) for r in forward_order(merged) if r.point == "p"]
    assert order == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    assert all(r.vector[0] == r.token_position * 10 + r.layer for r in forward_order(merged))


def test_preemption_recompute_is_delivered_once_across_drains():
    delivered = DeliveredPositions()
    first = delivered.filter(merge_blocks([block("p", 0, [("a", 0), ("a", 1), ("a", 2), ("b", 0)])]))
    assert keys_of(first[0]) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    # "a" was preempted and recomputes 0..3; "b" continues.
    second = delivered.filter(
        merge_blocks([block("p", 0, [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 1)], offset=0.5)])
    )
    assert keys_of(second[0]) == [("a", 3), ("b", 1)]
    assert delivered.discarded == 3
    assert delivered.filter(merge_blocks([block("p", 0, [("a", 1)])])) == []


def test_recompute_within_one_drain_is_deduplicated_by_key():
    (merged,) = merge_blocks([block("p", 0, [("a", 0), ("a", 1)]), block("p", 0, [("a", 0), ("a", 1), ("a", 2)], offset=0.5)])
    assert keys_of(merged) == [("a", 0), ("a", 1), ("a", 2)]
    assert merged.rows[:, 0].tolist() == [0.0, 10.0, 20.5]


def test_forget_frees_a_request_and_its_children():
    delivered = DeliveredPositions()
    delivered.filter(merge_blocks([block("p", 0, [("a", 5), ("0_a", 5), ("b", 5)])]))
    delivered.forget({"a"})
    again = delivered.filter(merge_blocks([block("p", 0, [("a", 5), ("0_a", 5), ("b", 5)])]))
    assert keys_of(again[0]) == [("a", 5), ("0_a", 5)]


def test_points_named_alike_by_two_requests_stay_apart_by_tensor_type():
    residual = block("x", 1, [("a", 0), ("a", 1)])
    attn = dataclasses.replace(block("x", 1, [("b", 0)]), tensor_type=types_pb.TENSOR_TYPE_ATTN_OUT)
    merged = merge_blocks([residual, attn])
    assert [(b.point, b.layer, b.tensor_type, keys_of(b)) for b in merged] == [
        ("x", 1, types_pb.TENSOR_TYPE_RESIDUAL_STREAM, [("a", 0), ("a", 1)]),
        ("x", 1, types_pb.TENSOR_TYPE_ATTN_OUT, [("b", 0)]),
    ]


def test_rows_of_different_widths_raise_instead_of_merging():
    with pytest.raises(ShapeMismatch, match=r"point 'p' layer 0: workers shipped rows of shapes \[\[2\], \[3\]\]"):
        merge_blocks([block("p", 0, [("a", 0)]), block("p", 0, [("a", 1)], hidden=3)])


def test_gate_releases_a_spanning_point_only_when_every_stage_delivered():
    """Pipeline stages drained mid-flight: the first stage has computed positions
    0..2 of layers 0-1 while the second stage has only done 0..1 of layers 2-3."""
    gate = ForwardOrderGate()
    gate.hold("r", "p", 4)
    first = gate.release(
        merge_blocks(
            [
                block("p", 0, [("r", 0), ("r", 1), ("r", 2)]),
                block("p", 1, [("r", 0), ("r", 1), ("r", 2)]),
                block("p", 2, [("r", 0), ("r", 1)]),
                block("p", 3, [("r", 0), ("r", 1)]),
                block("single", 0, [("r", 2)]),  # a point on one stage passes at once
                block("p", 0, [("other", 7)]),  # another request's point on one stage
            ]
        ),
        ending=set(),
    )
    order = [(r.request_id, r.point, r.token_position, r.layer) for r in forward_order(first)]
    assert order == [
        ("other", "p", 7, 0),
        ("r", "p", 0, 0), ("r", "p", 0, 1), ("r", "p", 0, 2), ("r", "p", 0, 3),
        ("r", "p", 1, 0), ("r", "p", 1, 1), ("r", "p", 1, 2), ("r", "p", 1, 3),
        ("r", "single", 2, 0),
    ]
    second = gate.release(
        merge_blocks([block("p", 2, [("r", 2)]), block("p", 3, [("r", 2)]), block("p", 0, [("r", 3)])]),
        ending=set(),
    )
    assert [(r.token_position, r.layer) for r in forward_order(second)] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    # The request ends (e.g. aborted) with position 3 still incomplete: it is released.
    last = gate.release([], ending={"r"})
    assert [(r.token_position, r.layer) for r in forward_order(last)] == [(3, 0)]
    assert gate.release([], ending=set()) == []


def test_random_drains_deliver_each_key_once_with_the_first_copy_like_a_reference():
    """Vectorised merge and filter against a dict-per-key reference, over random
    drains with TP duplicates, preemption restarts and interleaved requests."""
    rng = np.random.default_rng(11)
    delivered = DeliveredPositions()
    reference: dict[tuple, float] = {}
    got: dict[tuple, float] = {}
    progress = {r: 0 for r in ("a", "b", "c", "0_d", "1_d")}
    for drain in range(40):
        arrivals = []
        for request in rng.permutation(list(progress)).tolist():
            if rng.uniform() < 0.15:
                progress[request] = int(rng.integers(0, progress[request] + 1))  # preempted: recompute
            start, count = progress[request], int(rng.integers(0, 4))
            progress[request] += count
            for layer in (0, 1):
                keys = [(request, p) for p in range(start, start + count)]
                if keys:
                    arrivals.append(block("p", layer, keys, offset=drain / 100))
                    if rng.uniform() < 0.3:  # a TP duplicate of the same rows
                        arrivals.append(block("p", layer, keys, offset=drain / 100 + 0.001))
        for b in arrivals:
            for (request, position), value in zip(keys_of(b), b.rows[:, 0].tolist()):
                reference.setdefault((request, b.layer, position), value)
        for b in delivered.filter(merge_blocks(arrivals)):
            requests = [request for request, _ in keys_of(b)]
            # Each request's rows together, requests in the order they first arrived.
            arrived = list(dict.fromkeys(request for a in arrivals if a.layer == b.layer for request in a.request_ids))
            assert list(dict.fromkeys(requests)) == [r for r in arrived if r in requests]
            assert keys_of(b) == sorted(keys_of(b), key=lambda key: (requests.index(key[0]), key[1]))
            for (request, position), value in zip(keys_of(b), b.rows[:, 0].tolist()):
                key = (request, b.layer, position)
                assert key not in got, f"{key} delivered twice"
                got[key] = value
    assert got == reference


def test_decoded_parts_with_many_requests_and_reused_slots_deliver_each_key_once():
    """The path a drain takes (wire parts -> decode_parts -> merge -> filter), where a
    step's blocks share one key set, with more requests than the marks' first
    capacity, requests ending (their slots reused by new ones, which must start
    with no mark) and preemption restarts, against a dict-per-key reference."""
    rng = np.random.default_rng(5)
    delivered = DeliveredPositions()
    reference: dict[tuple, float] = {}
    got: dict[tuple, float] = {}
    progress: dict[str, int] = {}
    for drain in range(60):
        for _ in range(int(rng.integers(0, 12))):  # new requests, some reusing ended ids' slots
            progress[f"r{drain}-{len(progress)}"] = 0
        ending = {r for r in progress if rng.uniform() < 0.1}
        keys = []
        for request in sorted(progress):
            if rng.uniform() < 0.1:
                progress[request] = int(rng.integers(0, progress[request] + 1))  # preempted
            start, count = progress[request], int(rng.integers(0, 3))
            progress[request] += count
            keys += [(request, p) for p in range(start, start + count)]
        if not keys:
            continue
        parts = [encode_part(block(point, layer, keys, offset=drain / 100))
                 for point in ("p", "q") for layer in (0, 1, 2)]
        decoded = decode_parts(parts)
        assert all(b.request_ids is decoded[0].request_ids for b in decoded)  # one key set, shared
        for b in decoded:
            for (request, position), value in zip(keys_of(b), b.rows[:, 0].tolist()):
                reference.setdefault((request, b.point, b.layer, position), value)
        for b in delivered.filter(merge_blocks(decoded)):
            for (request, position), value in zip(keys_of(b), b.rows[:, 0].tolist()):
                key = (request, b.point, b.layer, position)
                assert key not in got, f"{key} delivered twice"
                got[key] = value
        delivered.forget(ending)
        for request in ending:  # an ended request's keys may come again only as a new request
            del progress[request]
            reference = {k: v for k, v in reference.items() if k[0] != request}
            got = {k: v for k, v in got.items() if k[0] != request}
    assert len(got) > 500 and got == reference


def test_a_slot_freed_by_an_ended_request_starts_its_next_owner_with_no_mark():
    delivered = DeliveredPositions()
    assert len(delivered.filter([block("p", 0, [("a", 9)])])) == 1
    delivered.forget({"a"})
    # "b" takes the slot "a" had; its position 0 is new, whatever "a" reached.
    (kept,) = delivered.filter([block("p", 0, [("b", 0)])])
    assert keys_of(kept) == [("b", 0)]
    assert delivered.discarded == 0
