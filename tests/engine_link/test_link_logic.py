"""The router link's pure logic (targets, assignment, batching, send queue,
step ledger), without gRPC."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest
from undercurrent.v1 import router_session_pb2 as session_pb

from common.activations import Block, from_batch, to_batch
from common import router_targets as targets
from engine_service.link import assignment, batching
from engine_service.link.send_queue import OverflowPolicy, QueuedBatch, SendQueue
from engine_service.link.session import StepLedger
from common.router_targets import DnsTarget, StaticTargets

from .helpers import step

REQUESTS = [f"req-{i}" for i in range(2000)]


# -- targets -----------------------------------------------------------------


def test_parse_static_list():
    assert targets.parse_targets(" a:1, 10.0.0.2:50051,[::1]:7 ") == StaticTargets(
        ("a:1", "10.0.0.2:50051", "[::1]:7")
    )


def test_parse_dns_target():
    assert targets.parse_targets("dns:routers.ns.svc:50052") == DnsTarget("routers.ns.svc", 50052)
    assert targets.parse_targets("dns:///router:9") == DnsTarget("router", 9)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "empty"),
        ("host", "host:port"),
        ("host:0", "1..65535"),
        ("host:http", "1..65535"),
        (":50051", "missing host"),
        ("::1:50051", "[addr]:port"),
        ("a:1,a:1", "twice"),
        ("dns:router", "host:port"),
    ],
)
def test_parse_rejects(spec, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(".", r"\.")):
        targets.parse_targets(spec)


# -- rendezvous hashing ------------------------------------------------------


def test_weight_is_stable_blake2b_not_python_hash():
    expected = int.from_bytes(hashlib.blake2b(b"r1:1\x00req-7", digest_size=8).digest(), "big")
    assert assignment.rendezvous_weight("req-7", "r1:1") == expected


def test_pick_is_order_independent_and_none_without_replicas():
    replicas = ["a:1", "b:1", "c:1"]
    for key in REQUESTS[:200]:
        assert assignment.pick_replica(key, replicas) == assignment.pick_replica(key, reversed(replicas))
    assert assignment.pick_replica("x", []) is None


def test_spread_over_replicas():
    replicas = ["a:1", "b:1", "c:1", "d:1"]
    counts = Counter(assignment.pick_replica(k, replicas) for k in REQUESTS)
    assert set(counts) == set(replicas)
    assert all(400 <= n <= 600 for n in counts.values()), counts  # 500 expected each


def test_minimal_movement_when_a_replica_leaves_or_joins():
    replicas = ["a:1", "b:1", "c:1", "d:1"]
    before = {k: assignment.pick_replica(k, replicas) for k in REQUESTS}
    after_leave = {k: assignment.pick_replica(k, ["a:1", "b:1", "d:1"]) for k in REQUESTS}
    moved = {k for k in REQUESTS if before[k] != after_leave[k]}
    assert moved == {k for k in REQUESTS if before[k] == "c:1"}

    after_join = {k: assignment.pick_replica(k, [*replicas, "e:1"]) for k in REQUESTS}
    joined = {k for k in REQUESTS if before[k] != after_join[k]}
    assert all(after_join[k] == "e:1" for k in joined)
    assert 300 <= len(joined) <= 500  # about a fifth of the keys


def test_backoff_grows_caps_and_jitters():
    assert assignment.backoff_delay(0, 0.1, 5.0, 1.0) == pytest.approx(0.1)
    assert assignment.backoff_delay(3, 0.1, 5.0, 1.0) == pytest.approx(0.8)
    assert assignment.backoff_delay(3, 0.1, 5.0, 0.0) == pytest.approx(0.4)
    assert assignment.backoff_delay(50, 0.1, 5.0, 1.0) == pytest.approx(5.0)


# -- partition and split -----------------------------------------------------


def test_partition_by_owner_keeps_order_and_sends_unowned_to_none():
    blocks = [
        step({"a": [0, 1], "b": [0], "c": [5]}, layer=0),
        step({"a": [0, 1], "b": [0]}, layer=1),
    ]
    owners = {"a": "r1", "b": "r2", "c": None}
    parts = batching.partition_by_owner(blocks, owners.get)
    assert [(b.layer, b.request_ids, b.token_positions.tolist()) for b in parts["r1"]] == [
        (0, ["a", "a"], [0, 1]),
        (1, ["a", "a"], [0, 1]),
    ]
    assert [(b.layer, b.request_ids) for b in parts["r2"]] == [(0, ["b"]), (1, ["b"])]
    assert [(b.layer, b.request_ids) for b in parts[None]] == [(0, ["c"])]
    np.testing.assert_array_equal(parts["r1"][1].rows[:, 1], [0, 1])


def test_split_by_size_fits_limit_and_keeps_every_row_in_order():
    hidden = 64
    blocks = []
    for layer in range(3):
        block = step({f"request-{r}": list(range(40)) for r in range(3)}, layer=layer)
        block.rows = (
            np.random.default_rng(layer)
            .standard_normal((block.num_rows, hidden))
            .astype(np.float32)
        )
        blocks.append(block)
    limit = 20_000
    parts = batching.split_by_size(blocks, limit)
    assert len(parts) > 1
    for part in parts:
        message = session_pb.SessionRequest(batch=to_batch(part, step=2**40))
        assert message.ByteSize() <= limit
    sent = [
        (b.layer, r, int(p))
        for part in parts
        for b in part
        for r, p in zip(b.request_ids, b.token_positions)
    ]
    assert sent == [
        (b.layer, r, int(p)) for b in blocks for r, p in zip(b.request_ids, b.token_positions)
    ]
    decoded = np.concatenate([d.rows for part in parts for d in from_batch(to_batch(part))])
    np.testing.assert_array_equal(decoded, np.concatenate([b.rows for b in blocks]))


def test_split_by_size_leaves_a_small_step_whole():
    blocks = [step({"a": [0, 1]}), step({"a": [0, 1]}, layer=1)]
    assert batching.split_by_size(blocks, 1 << 20) == [blocks]


def test_split_by_size_refuses_a_row_over_the_limit():
    with pytest.raises(batching.RowTooLarge, match="probe.residual_stream.0@0"):
        batching.split_by_size([step({"a": [0]})], 100)


def test_rows_per_point():
    blocks = [step({"a": [3, 4], "b": [9]}), step({"a": [3, 4]}, layer=1), step({"a": [5]}, layer=1)]
    assert batching.rows_by_point(blocks) == {
        "a": {"probe.residual_stream.0": [3, 4], "probe.residual_stream.1": [3, 4, 5]},
        "b": {"probe.residual_stream.0": [9]},
    }


def test_blocks_sharing_key_objects_are_routed_and_counted_as_separate_blocks():
    """Blocks of one step share key objects (decode_parts); the per-key-set work done
    once for them must still count, route and size every block's rows."""
    first = step({"a": [3, 4], "b": [9]})
    shared = [first] + [Block(f"probe.residual_stream.{layer}", first.tensor_type, layer, first.rows + layer,
                              first.request_ids, first.token_positions, first.is_generated) for layer in (1, 2)]
    other = step({"a": [5]}, layer=3)
    blocks = shared + [other]
    assert batching.rows_by_point(blocks) == {
        "a": {**{f"probe.residual_stream.{layer}": [3, 4] for layer in (0, 1, 2)}, "probe.residual_stream.3": [5]},
        "b": {f"probe.residual_stream.{layer}": [9] for layer in (0, 1, 2)},
    }
    parts = batching.partition_by_owner(blocks, owner_of={"a": "r1", "b": "r2"}.get)
    assert [(b.layer, b.request_ids, b.token_positions.tolist(), b.rows[:, 0].tolist()) for b in parts["r1"]] == [
        (layer, ["a", "a"], [3, 4], (first.rows[:2, 0] + layer).tolist()) for layer in (0, 1, 2)
    ] + [(3, ["a"], [5], other.rows[:, 0].tolist())]
    assert [(b.layer, b.request_ids) for b in parts["r2"]] == [(layer, ["b"]) for layer in (0, 1, 2)]


# -- send queue --------------------------------------------------------------


def batch(name: str, rows: int = 1, nbytes: int = 10) -> QueuedBatch:
    return QueuedBatch(name, nbytes, rows)


def drain(queue: SendQueue) -> list:
    items = []
    while queue:
        item = queue.pop()
        items.append(item.batch_bytes if isinstance(item, QueuedBatch) else item)
    return items


def test_drop_oldest_evicts_the_oldest_batch_never_control():
    queue = SendQueue(2, 1000, OverflowPolicy.DROP_OLDEST)
    queue.put_control("start")
    assert queue.put_batch(batch("b1")) == []
    assert queue.put_batch(batch("b2")) == []
    assert [d.batch_bytes for d in queue.put_batch(batch("b3"))] == ["b1"]
    queue.put_control("end")
    assert drain(queue) == ["start", "b2", "b3", "end"]


def test_drop_newest_refuses_the_new_batch():
    queue = SendQueue(2, 1000, OverflowPolicy.DROP_NEWEST)
    queue.put_batch(batch("b1"))
    queue.put_batch(batch("b2"))
    assert [d.batch_bytes for d in queue.put_batch(batch("b3"))] == ["b3"]
    assert drain(queue) == ["b1", "b2"]


def test_byte_bound_and_clear():
    queue = SendQueue(100, 25, OverflowPolicy.DROP_OLDEST)
    queue.put_batch(batch("b1", nbytes=10))
    queue.put_batch(batch("b2", nbytes=10))
    assert [d.batch_bytes for d in queue.put_batch(batch("b3", nbytes=10))] == ["b1"]
    queue.put_control("hb")
    assert [b.batch_bytes for b in queue.clear()] == ["b2", "b3"]
    assert (len(queue), queue.batches, queue.nbytes) == (0, 0, 0)


# -- ack ledger --------------------------------------------------------------


def test_step_ledger_numbers_steps_and_settles_cumulatively():
    ledger = StepLedger()
    first, second, third = batch("b1"), batch("b2"), batch("b3")
    assert ledger.record(first, now=1.0) == 1
    assert ledger.record(second, now=2.0) == 2
    assert ledger.record(third, now=3.0) == 3
    assert ledger.batch_of(2) is second and ledger.batch_of(9) is None
    settled = ledger.ack(2)
    assert settled.batches == [first, second]
    assert settled.sent_at == [1.0, 2.0]
    assert ledger.ack(2).batches == []  # a duplicate ack settles nothing
    assert ledger.ack(3).batches == [third]
    assert ledger.pending == {}
