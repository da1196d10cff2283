"""SessionState alone, with no gRPC: what it answers to broken batches and limits."""

import gc

import numpy as np
import pytest

from common.activations import to_batch
from router_service.metrics import RouterMetrics
from common.probe_format.files import load_probe_path
from router_service.registry import ProbeRegistry
from router_service.session import SessionState
from tests.router.helpers import HIDDEN, block, bound, linear_probe, model_info
from google.rpc import code_pb2
from undercurrent.v1 import router_session_pb2 as session_pb


@pytest.fixture
def state(tmp_path):
    registry = ProbeRegistry()
    registry.load(load_probe_path(linear_probe(tmp_path, "watch", np.eye(HIDDEN)[0], kind="linear",
                                               threshold=0.0, action="observe", tokens={"scope": "all"})))
    return SessionState(registry, model_info(), RouterMetrics(), max_requests=2)


def start(state, rid, incarnation, **binding):
    return state.start(session_pb.RequestStart(request_id=rid, incarnation=incarnation,
                                       bindings=bound(state.registry, "watch", **binding)))


def rows(*values):
    out = np.zeros((len(values), HIDDEN))
    out[:, 0] = values
    return out


def summary(replies):
    return [(m.WhichOneof("message"), m.error.request_id or m.scores.probe_scores.request_id, m.error.incarnation or
             m.scores.incarnation, m.error.step or m.ack.step) for m in replies]


def test_a_batch_that_fails_whole_names_each_request_with_its_incarnation_and_step(state):
    start(state, "a", 1)
    start(state, "b", 2)
    batch = to_batch([block(rows(1.0, 2.0), ["a", "b"], [0, 0])], step=9)
    replies = state.batch_failed(batch, RuntimeError("boom"))
    assert summary(replies) == [("error", "a", 1, 9), ("error", "b", 2, 9), ("ack", "", 0, 9)]
    assert {m.error.code for m in replies[:2]} == {code_pb2.INTERNAL}


def test_rows_of_a_refused_request_start_are_refused_naming_its_incarnation(state):
    """A router that refused a run (draining, full) says so about each of its
    later batches with the run's incarnation, so the engine fails the right run's
    rows, not an earlier or later one's."""
    start(state, "a", 1)
    start(state, "b", 2)
    [full] = start(state, "c", 3)  # the state holds two requests
    assert (full.error.code, full.error.incarnation) == (code_pb2.RESOURCE_EXHAUSTED, 3)
    replies = state.batch(to_batch([block(rows(1.0, 2.0), ["a", "c"], [0, 0])], step=5))
    assert summary(replies) == [("error", "c", 3, 5), ("scores", "a", 1, 0), ("ack", "", 0, 5)]
    assert replies[0].error.message == ("blocks[0] (p@1): records for request 'c', whose request_start this "
                                        "session refused; not scored")


def test_an_overflowing_block_is_refused_alone(state):
    start(state, "a", 1)
    start(state, "b", 2)
    batch = to_batch([block(rows(1.0), ["a"], [0]), block(rows(2.0), ["b"], [0], point="q")], step=4)
    del batch.blocks[0].rows.shape[:]
    batch.blocks[0].rows.shape.extend([2**32, 2**32])
    batch.blocks[0].rows.data = b""
    replies = state.batch(batch)
    assert summary(replies) == [("error", "a", 1, 4), ("scores", "b", 2, 0), ("ack", "", 0, 4)]
    assert "needs 73786976294838206464" in replies[0].error.message


def test_negative_positions_are_refused_and_the_other_rows_scored(state):
    start(state, "a", 3)
    replies = state.batch(to_batch([block(rows(1.0, 2.0), ["a", "a"], [-1, 5])], step=2))
    assert summary(replies) == [("error", "a", 3, 2), ("scores", "a", 3, 0), ("ack", "", 0, 2)]
    assert list(replies[1].scores.probe_scores.token_positions) == [5]


def test_unknown_enums_and_the_request_limit(state):
    [refused] = start(state, "a", 1, failure_policy=9)
    assert (refused.error.request_id, refused.error.incarnation, refused.error.message) == (
        "a", 1, "request_start.bindings[0].failure_policy: 9 is not a FailurePolicy")
    assert start(state, "b", 2) == []
    [over] = start(state, "c", 3)
    assert (over.error.code, over.error.request_id, over.error.incarnation) == (
        code_pb2.RESOURCE_EXHAUSTED, "c", 3)
    assert sorted(state.requests) == ["a", "b"]


def test_probes_reading_the_same_rows_keep_their_own_rules_and_state(tmp_path):
    """Probes on the same rows are ordered and ruled together (one group), each
    with its own threshold, patience and per-request state across batches."""
    registry = ProbeRegistry()
    rules = {"low": (1.0, 3), "mid": (2.0, 2), "high": (3.0, 1)}  # threshold, patience
    for name, (threshold, patience) in rules.items():
        registry.load(load_probe_path(linear_probe(tmp_path, name, np.eye(HIDDEN)[0], kind="linear",
                                                   threshold=threshold, rule={"patience": patience})))
    state = SessionState(registry, model_info(), RouterMetrics())
    # Every request binds all three (so they read the same rows); "g" in another order.
    values = {
        "a": [2.5, 2.5, 0.0, 3.5, 0.0, 0.0],  # mid at 1, before high at 3
        "b": [0.0, 2.0, 2.0, 0.0, 0.0, 0.0],  # mid at 2: its streak carried from batch 1
        "c": [1.5, 1.5, 1.5, 0.0, 0.0, 0.0],  # low at 2: a streak of three across batches
        "d": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0],  # never
        "e": [0.0, 0.0, 0.0, 0.0, 0.0, 3.0],  # high at 5, in the last batch
        # low at 2. mid's streak is 0 after batch 1 (low's is 2): had mid been given
        # low's state, it would fire at 2 too and win, bound first.
        "g": [2.5, 1.5, 2.5, 0.0, 0.0, 0.0],
    }
    order = {rid: ["low", "mid", "high"] for rid in values} | {"g": ["mid", "high", "low"]}
    for rid, names in order.items():
        assert state.start(session_pb.RequestStart(request_id=rid, bindings=bound(state.registry, *names))) == []
    verdicts = {}
    for step, first in enumerate(range(0, 6, 2), 1):  # two positions per request and batch
        ids = [rid for rid in values for _ in (0, 1)]
        positions = [p for _ in values for p in (first, first + 1)]
        replies = state.batch(to_batch([block(rows(*[values[r][p] for r, p in zip(ids, positions)]),
                                              ids, positions)], step=step))
        verdicts |= {m.abort.verdict.request_id: (m.abort.verdict.probe, m.abort.verdict.token_position)
                     for m in replies if m.WhichOneof("message") == "abort"}

    def first_firing(rid):
        fired = []
        for rank, name in enumerate(order[rid]):
            threshold, patience = rules[name]
            streak = 0
            for position, value in enumerate(values[rid]):
                streak = streak + 1 if value >= threshold else 0
                if streak >= patience:
                    fired.append((position, rank, name))
                    break
        return min(fired, default=None)

    assert verdicts == {"a": ("mid", 1), "b": ("mid", 2), "c": ("low", 2), "e": ("high", 5), "g": ("low", 2)}
    assert verdicts == {rid: (hit[2], hit[0]) for rid in values if (hit := first_firing(rid))}


def test_rule_state_survives_the_grid_growing_and_freed_cells_start_clean(tmp_path):
    """Each binding's rule state is a cell of the session's [request, probe] grid:
    it keeps its streak while the grid grows past its 16 x 16 cells for new
    requests and probes, and a request or probe that takes a freed row or column
    starts from a clean cell, with its own threshold and patience."""
    registry = ProbeRegistry()
    for i in range(24):  # patience 2 on row[0] >= 1; "p23" at >= 0.5
        registry.load(load_probe_path(linear_probe(tmp_path, f"p{i}", np.eye(HIDDEN)[0], kind="linear",
                                                   threshold=0.5 if i == 23 else 1.0, rule={"patience": 2})))
    state = SessionState(registry, model_info(), RouterMetrics())

    def bind(rid, *probes):
        assert state.start(session_pb.RequestStart(request_id=rid, bindings=bound(state.registry, *probes))) == []

    def aborts(step, ids, positions, values):
        replies = state.batch(to_batch([block(rows(*values), ids, positions)], step=step))
        assert [m.WhichOneof("message") for m in replies][-1] == "ack"
        assert not [m for m in replies if m.WhichOneof("message") == "error"]
        return {m.abort.verdict.request_id: (m.abort.verdict.probe, m.abort.verdict.token_position)
                for m in replies if m.WhichOneof("message") == "abort"}

    bind("held", "p0")
    assert aborts(1, ["held"], [0], [1.0]) == {}  # a streak of one
    for i in range(20):  # 20 more requests and 21 more probes: the grid grows both ways
        bind(f"r{i}", *(f"p{j}" for j in range(1, 22)))
    assert aborts(2, ["held"], [1], [1.0]) == {"held": ("p0", 1)}  # the streak carried through the growth

    bind("first", "p22")
    assert aborts(3, ["first"], [0], [1.0]) == {}  # a streak of one in the cell ("first", "p22")
    state.end(session_pb.RequestEnd(request_id="held"))
    state.end(session_pb.RequestEnd(request_id="first"))  # p0 and p22 are bound by no request now: columns freed
    bind("second", "p23")  # takes the row and the column freed last: that cell
    assert aborts(4, ["second"], [0], [1.0]) == {}  # no streak inherited
    assert aborts(5, ["second"], [1], [0.7]) == {"second": ("p23", 1)}  # p23's own threshold


def test_a_request_named_twice_in_one_batch_has_the_second_slots_rows_refused(state):
    """request_ids naming a request again (an engine keeps one slot per request):
    the rows through the later slot are refused with an error naming both
    indexes, the rest of the batch is scored, and no unknown-request error is made up."""
    start(state, "a", 1)
    start(state, "b", 2)
    batch = to_batch([block(rows(1.0, 2.0, 3.0), ["a", "b", "a"], [0, 0, 1])], step=6)
    assert list(batch.request_ids) == ["a", "b"]
    batch.request_ids.append("a")
    batch.blocks[0].request_index[2] = 2  # the row at position 1 names "a" through [2]
    replies = state.batch(batch)
    assert summary(replies) == [("error", "a", 1, 6), ("scores", "a", 1, 0), ("scores", "b", 2, 0), ("ack", "", 0, 6)]
    assert replies[0].error.code == code_pb2.INVALID_ARGUMENT
    assert replies[0].error.message == (
        "batch.request_ids[2]: request 'a' is named again (first at [0]); the rows naming [2] were not scored")
    scored = replies[1].scores.probe_scores
    assert (list(scored.token_positions), list(scored.scores)) == ([0], [1.0])


def test_open_bindings_give_the_garbage_collector_nothing_to_walk(tmp_path):
    """A full collection walks every tracked object, on the router's event loop:
    requests of many probes must not add an object per binding (they added five)."""
    registry, names = ProbeRegistry(), [f"p{i}" for i in range(200)]
    for name in names:
        registry.load(load_probe_path(linear_probe(tmp_path, name, np.eye(HIDDEN)[0], threshold=0.5)))
    state = SessionState(registry, model_info(), RouterMetrics())

    def open_requests(first, count):
        for i in range(first, first + count):
            assert state.start(session_pb.RequestStart(request_id=f"r{i}", bindings=bound(state.registry, *names))) == []
        gc.collect()
        return len(gc.get_objects())

    before = open_requests(0, 10)
    after = open_requests(10, 20)  # 4,000 more bindings
    assert after - before < 20 * 10, f"{after - before} objects tracked for 20 requests of 200 probes"
