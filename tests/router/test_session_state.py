"""SessionState alone, with no gRPC: what it answers to broken batches and limits."""

import numpy as np
import pytest

from common.activations import to_batch
from router_service.metrics import RouterMetrics
from router_service.probe_files import load_probe_path
from router_service.registry import ProbeRegistry
from router_service.session import SessionState
from tests.router.helpers import HIDDEN, block, linear_probe, model_info
from undercurrent.v1 import undercurrent_pb2 as pb


@pytest.fixture
def state(tmp_path):
    registry = ProbeRegistry()
    registry.load(load_probe_path(linear_probe(tmp_path, "watch", np.eye(HIDDEN)[0], kind="linear",
                                               threshold=0.0, action="observe", tokens={"scope": "all"})))
    return SessionState(registry, model_info(), RouterMetrics(), max_requests=2)


def start(state, rid, incarnation, **binding):
    return state.start(pb.RequestStart(request_id=rid, incarnation=incarnation,
                                       probes=[pb.ProbeBinding(probe="watch", **binding)]))


def rows(*values):
    out = np.zeros((len(values), HIDDEN))
    out[:, 0] = values
    return out


def summary(replies):
    return [(m.WhichOneof("message"), m.error.request_id or m.scores.request_id, m.error.incarnation or
             m.scores.incarnation, m.error.step or m.ack.step) for m in replies]


def test_a_batch_that_fails_whole_names_each_request_with_its_incarnation_and_step(state):
    start(state, "a", 1)
    start(state, "b", 2)
    batch = to_batch([block(rows(1.0, 2.0), ["a", "b"], [0, 0])], step=9)
    replies = state.batch_failed(batch, RuntimeError("boom"))
    assert summary(replies) == [("error", "a", 1, 9), ("error", "b", 2, 9), ("ack", "", 0, 9)]
    assert {m.error.code for m in replies[:2]} == {pb.STATUS_CODE_INTERNAL}


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
    assert list(replies[1].scores.token_positions) == [5]


def test_unknown_enums_and_the_request_limit(state):
    [refused] = start(state, "a", 1, failure_policy=9)
    assert (refused.error.request_id, refused.error.incarnation, refused.error.message) == (
        "a", 1, "request_start.probes[0].failure_policy: 9 is not a FailurePolicy")
    assert start(state, "b", 2) == []
    [over] = start(state, "c", 3)
    assert (over.error.code, over.error.request_id, over.error.incarnation) == (
        pb.STATUS_CODE_RESOURCE_EXHAUSTED, "c", 3)
    assert sorted(state.requests) == ["a", "b"]
