"""Per-step row mapping from vLLM's flat batch to capture keys (no vLLM needed)."""

import numpy as np

from common.capture_spec import ExtractionPoint, Scope, TokenSelector
from engine_service.capture.worker.row_mapping import (
    PromptGap,
    Registration,
    RowMapper,
)
from engine_service.capture.request_ids import record_request_id


def point(name, tensor_type="residual_stream", layers=(0,), selector=TokenSelector()):
    return ExtractionPoint(name, tensor_type, layers, selector)


def test_request_ids_map_back_through_vllm_suffixes():
    registered = {"req-1", "7"}
    assert record_request_id("req-1-0123abcd", registered) == "req-1"
    assert record_request_id("req-1-0123abcd89ef0123", registered) == "req-1"
    assert record_request_id("7-deadbeef", registered) == "7"
    # Children of an n>1 request keep vLLM's "<index>_<id>" so their rows stay apart.
    assert record_request_id("1_req-1-0123abcd", registered) == "1_req-1"
    # Randomisation disabled: the id arrives unchanged.
    assert record_request_id("req-1", registered) == "req-1"
    assert record_request_id("other-0123abcd", registered) is None


def test_plan_selects_rows_per_request_with_chunked_prefill_and_padding():
    mapper = RowMapper(range(0, 2), num_layers=4, has_final_norm=False)
    mapper.register(Registration("a", (point("last", selector=TokenSelector(Scope.PROMPT, (-1,))),), 6))
    mapper.register(Registration("b", (point("gen", layers=(1, 3), selector=TokenSelector(Scope.GENERATED)),), 2))
    # Slot 0: an unregistered request decoding; slot 1: "a" prefilling its chunk
    # [3, 6); slot 2: "b" decoding generated token 0 (position 2). Rows 6..7 are padding.
    req_ids = ["x-00000000", "a-11111111", "b-22222222"]
    query_start_loc = np.array([0, 1, 4, 5])
    positions = np.array([9, 3, 4, 5, 2, 0, 0, 0])
    plan = mapper.plan(req_ids, query_start_loc, positions)

    assert sorted(plan) == [("residual_stream", 0), ("residual_stream", 1)]
    (a,) = plan[("residual_stream", 0)]
    assert (a.request_ids, a.point, a.row_indices.tolist(), a.positions.tolist()) == (["a"], "last", [3], [5])
    assert a.is_generated.tolist() == [False]
    (b,) = plan[("residual_stream", 1)]  # layer 3 belongs to another stage
    assert (b.request_ids, b.point, b.row_indices.tolist(), b.positions.tolist()) == (["b"], "gen", [4], [2])
    assert b.is_generated.tolist() == [True]


def test_each_points_rows_of_a_step_are_joined_in_batch_order_for_one_gather():
    mapper = RowMapper(range(0, 2), num_layers=2, has_final_norm=False)
    for request_id, prompt_tokens in (("a", 3), ("b", 2)):
        mapper.register(Registration(request_id, (point("all", layers=(0, 1)), point("gen", layers=(1,),
                                                  selector=TokenSelector(Scope.GENERATED))), prompt_tokens))
    # Slot 0: "a" prefills positions 0..2; slot 1: "b" decodes position 2 (generated).
    joined = mapper.plan(["a-00000000", "b-11111111"], np.array([0, 3, 4]), np.array([0, 1, 2, 2]))
    assert [(p.point, p.layer) for p in joined[("residual_stream", 0)]] == [("all", 0)]
    everything, generated = joined[("residual_stream", 1)]
    assert (everything.point, everything.row_indices.tolist(), everything.request_ids,
            everything.positions.tolist(), everything.is_generated.tolist()) == (
        "all", [0, 1, 2, 3], ["a", "a", "a", "b"], [0, 1, 2, 2], [False, False, False, True])
    assert (generated.point, generated.row_indices.tolist(), generated.request_ids) == ("gen", [3], ["b"])
    # A point's layers share the rows, computed once.
    assert joined[("residual_stream", 0)][0].row_indices is everything.row_indices


def test_requests_sharing_a_point_are_selected_together_each_by_its_own_prompt_length():
    """Equal specs registered by different requests make one selection over all
    their rows (prefill chunks and decodes mixed), in batch order; a spec with the
    same name but another selector stays apart."""
    mapper = RowMapper(range(2), num_layers=2, has_final_norm=False)
    last_prompt = TokenSelector(Scope.PROMPT, (-1,))
    for request_id, prompt_tokens in (("a", 4), ("b", 2), ("c", 3)):
        mapper.register(Registration(request_id, (point("last", selector=last_prompt),
                                                  point("gen", selector=TokenSelector(Scope.GENERATED))), prompt_tokens))
    mapper.register(Registration("d", (point("last", selector=TokenSelector(Scope.ALL)),), 1))
    mapper.register(Registration("e", (point("gen", selector=TokenSelector(Scope.GENERATED)),), 1))
    # "a" prefills 0..3, "e" decodes 3, "x" is not captured, "b" decodes 2, "c"
    # prefills 1..2, "d" decodes 5. "e" registered "gen" alone, yet joins the others'.
    req_ids = ["a-00000000", "e-00000000", "x-00000000", "b-00000000", "c-00000000", "d-00000000"]
    plan = mapper.plan(req_ids, np.array([0, 4, 5, 6, 7, 9, 10]), np.array([0, 1, 2, 3, 3, 7, 2, 1, 2, 5]))
    last, gen, last_of_d = plan[("residual_stream", 0)]
    assert (last.point, last.row_indices.tolist(), last.request_ids, last.positions.tolist(),
            last.is_generated.tolist()) == ("last", [3, 8], ["a", "c"], [3, 2], [False, False])
    assert (gen.point, gen.row_indices.tolist(), gen.request_ids, gen.positions.tolist(),
            gen.is_generated.tolist()) == ("gen", [4, 6], ["e", "b"], [3, 2], [True, True])
    assert (last_of_d.point, last_of_d.row_indices.tolist(), last_of_d.request_ids) == ("last", [9], ["d"])
    # Unregistered, a request no longer shares anything; the others still select.
    mapper.unregister("a")
    plan = mapper.plan(req_ids[3:5], np.array([0, 1, 3]), np.array([3, 1, 2]))
    assert [(p.point, p.request_ids, p.positions.tolist()) for p in plan[("residual_stream", 0)]] == [
        ("last", ["c"], [2]), ("gen", ["b"], [3])]
    # Nothing is kept for the point specs of requests that ended.
    for request_id in "bcde":
        mapper.unregister(request_id)
    assert mapper._shared == {} and mapper._owned == {}


def test_final_norm_only_on_the_last_stage():
    norm = ExtractionPoint("n", "final_norm")
    args = (["a-00000000"], np.array([0, 2]), np.array([0, 1]))
    first = RowMapper(range(0, 2), num_layers=4, has_final_norm=False)
    last = RowMapper(range(2, 4), num_layers=4, has_final_norm=True)
    for mapper in (first, last):
        mapper.register(Registration("a", (norm,), 2))
    assert dict(first.plan(*args)) == {}
    assert [s.positions.tolist() for s in last.plan(*args)[("final_norm", 4)]] == [[0, 1]]


def test_nothing_registered_costs_no_work():
    mapper = RowMapper(range(4), num_layers=4, has_final_norm=True)
    assert dict(mapper.plan(["a-00000000"], np.array([0, 3]), np.arange(3))) == {}


def test_unregister_stops_capture_and_n_children_resolve_to_the_parent():
    mapper = RowMapper(range(4), num_layers=4, has_final_norm=True)
    mapper.register(Registration("p", (point("all"),), 2))
    plan = mapper.plan(["0_p-00000000", "1_p-00000000"], np.array([0, 1, 2]), np.array([2, 2]))
    assert [s.request_ids for s in plan[("residual_stream", 0)]] == [["0_p", "1_p"]]
    mapper.unregister("p")
    assert dict(mapper.plan(["0_p-00000000"], np.array([0, 1]), np.array([3]))) == {}


def test_prefix_cache_gap_is_reported_for_selected_positions_only():
    mapper = RowMapper(range(4), num_layers=4, has_final_norm=True)
    mapper.register(Registration("a", (point("prompt", selector=TokenSelector(Scope.PROMPT)),), 8))
    mapper.register(Registration("g", (point("gen", selector=TokenSelector(Scope.GENERATED)),), 8))
    # Both start at position 4: positions 0..3 came from the prefix cache.
    mapper.plan(["a-00000000", "g-00000000"], np.array([0, 4, 8]), np.array([4, 5, 6, 7] * 2))
    assert mapper.take_gaps() == [PromptGap("a", "prompt", 0, 4)]
    # A preemption restarting at 0 is not a gap.
    mapper.plan(["a-00000000"], np.array([0, 8]), np.arange(8))
    assert mapper.take_gaps() == []
