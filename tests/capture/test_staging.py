"""A step's rows gathered into one buffer and collected once (no vLLM needed)."""

import numpy as np
import torch

from engine_service.capture.worker.row_mapping import PointRows
from engine_service.capture.worker.staging import StepStaging


def rows(point: str, tensor_type: str, layer: int, indices: list[int]) -> PointRows:
    n = len(indices)
    return PointRows(point, tensor_type, layer, np.asarray(indices, np.int64), [f"r{i}" for i in range(n)],
                     np.arange(n, dtype=np.int64), np.ones(n, bool))


def test_each_site_gets_its_slice_and_collect_returns_the_rows_of_each_gather():
    plan = {
        ("residual_stream", 0): [rows("res", "residual_stream", 0, [1, 3])],
        ("mlp_out", 0): [rows("mlp_a", "mlp_out", 0, [0]), rows("mlp_b", "mlp_out", 0, [2, 3, 4])],
    }
    staging = StepStaging(plan, "cpu")
    assert staging.rows == 6
    assert [(s.point_rows.point, s.offset, s.index.tolist()) for key in plan for s in staging.plan[key]] == [
        ("res", 0, [1, 3]), ("mlp_a", 2, [0]), ("mlp_b", 3, [2, 3, 4])]

    hidden, residual = torch.randn(5, 4), torch.randn(5, 4)
    for staged in staging.plan[("residual_stream", 0)]:
        staging.gather(staged, hidden, residual)
    expected_residual = (hidden + residual)[[1, 3]].numpy()
    hidden += 100  # vLLM's norms work in place on what a site saw: the gather already copied
    mlp = torch.randn(5, 4)
    for staged in staging.plan[("mlp_out", 0)]:
        staging.gather(staged, mlp)

    collected = staging.collect()
    assert [(r.point, dtype) for r, _, dtype in collected] == [
        ("res", "float32"), ("mlp_a", "float32"), ("mlp_b", "float32")]
    np.testing.assert_array_equal(collected[0][1], expected_residual)
    np.testing.assert_array_equal(collected[1][1], mlp[[0]].numpy())
    np.testing.assert_array_equal(collected[2][1], mlp[[2, 3, 4]].numpy())
    assert staging.collect() == []  # each gather is collected once


def test_bfloat16_rows_come_back_as_their_bits():
    plan = {("final_norm", 3): [rows("norm", "final_norm", 3, [2, 0])]}
    staging = StepStaging(plan, "cpu")
    values = torch.randn(3, 8).to(torch.bfloat16)
    staging.gather(staging.plan[("final_norm", 3)][0], values)
    [(_, bits, dtype)] = staging.collect()
    assert dtype == "bfloat16" and bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, values[[2, 0]].view(torch.int16).numpy().view(np.uint16))


def test_sites_of_another_dtype_get_a_buffer_of_their_own():
    plan = {("attn_out", 0): [rows("a", "attn_out", 0, [0])], ("mlp_out", 0): [rows("m", "mlp_out", 0, [1])]}
    staging = StepStaging(plan, "cpu")
    wide, narrow = torch.randn(2, 4), torch.randn(2, 4).to(torch.bfloat16)
    staging.gather(staging.plan[("attn_out", 0)][0], wide)
    staging.gather(staging.plan[("mlp_out", 0)][0], narrow)
    [(_, first, first_dtype), (_, second, second_dtype)] = staging.collect()
    assert (first_dtype, second_dtype) == ("float32", "bfloat16")
    np.testing.assert_array_equal(first, wide[[0]].numpy())
    np.testing.assert_array_equal(second, narrow[[1]].view(torch.int16).numpy().view(np.uint16))


def test_a_step_with_no_rows_planned():
    staging = StepStaging({}, "cpu")
    assert staging.rows == 0 and staging.plan == {} and staging.collect() == []


def test_a_points_layers_share_one_index_on_the_device_and_keep_their_own_rows():
    shared = rows("res", "residual_stream", 0, [1, 3])
    on_layer_1 = PointRows("res", "residual_stream", 1, shared.row_indices, shared.request_ids,
                           shared.positions, shared.is_generated)  # as RowMapper.plan shares them
    plan = {("residual_stream", 0): [shared], ("residual_stream", 1): [on_layer_1]}
    staging = StepStaging(plan, "cpu")
    first, second = staging.plan[("residual_stream", 0)][0], staging.plan[("residual_stream", 1)][0]
    assert first.index.data_ptr() == second.index.data_ptr() and first.index.tolist() == [1, 3]
    assert (staging.rows, first.offset, second.offset) == (4, 0, 2)
    layer_0, layer_1 = torch.randn(5, 4), torch.randn(5, 4)
    staging.gather(first, layer_0)
    staging.gather(second, layer_1)
    (_, got_0, _), (_, got_1, _) = staging.collect()
    np.testing.assert_array_equal(got_0, layer_0[[1, 3]].numpy())
    np.testing.assert_array_equal(got_1, layer_1[[1, 3]].numpy())
