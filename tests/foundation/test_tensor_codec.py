import numpy as np
import pytest

from common import activations, tensor_codec
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_round_trip_is_exact(dtype):
    values = np.random.default_rng(0).normal(size=(5, 7)).astype(dtype)
    message = tensor_codec.encode(values)
    assert message.dtype == dtype and list(message.shape) == [5, 7]
    assert len(message.data) == values.nbytes
    np.testing.assert_array_equal(tensor_codec.decode(message, as_float32=False), values)


def test_bfloat16_matches_torch_rounding():
    import torch
    values = np.random.default_rng(1).normal(size=(4, 33)).astype(np.float32)
    message = tensor_codec.encode(values, "bfloat16")
    assert len(message.data) == values.size * 2
    expected = torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(tensor_codec.decode(message), expected)


def test_byte_length_mismatch_names_the_field():
    message = types_pb.Tensor(dtype="float32", shape=[2, 4], data=b"\0" * 12)
    with pytest.raises(tensor_codec.TensorDecodeError, match="tensor.data has 12 bytes but shape"):
        tensor_codec.decode(message)


def test_unknown_dtype_is_refused():
    with pytest.raises(tensor_codec.TensorDecodeError, match="'int8' is not supported"):
        tensor_codec.decode(types_pb.Tensor(dtype="int8", shape=[1], data=b"\0"))


def test_batch_round_trip_interns_request_ids_and_keeps_order():
    rng = np.random.default_rng(2)
    blocks = [
        activations.Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layer, rng.normal(size=(3, 8)).astype(np.float32),
                          ["a", "b", "a"], np.array([4, 4, 5]), np.array([True, False, True]))
        for layer in (1, 3)
    ]
    batch = activations.to_batch(blocks, step=7)
    assert batch.step == 7 and list(batch.request_ids) == ["a", "b"]
    assert list(batch.blocks[0].request_index) == [0, 1, 0]
    decoded = activations.from_batch(batch)
    for before, after in zip(blocks, decoded):
        np.testing.assert_array_equal(before.rows, after.rows)
        assert before.request_ids == after.request_ids and before.layer == after.layer


def test_forward_order_interleaves_layers_by_token():
    """Two pipeline stages deliver layer 1 and layer 3 as separate blocks; a
    probe must see them in the order the forward pass computed them."""
    rows = np.zeros((2, 4), np.float32)
    early = activations.Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, rows, ["r", "r"], np.array([7, 8]), np.array([True, True]))
    late = activations.Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 3, rows, ["r", "r"], np.array([7, 8]), np.array([True, True]))
    order = [(rec.token_position, rec.layer) for rec in activations.forward_order([late, early])]
    assert order == [(7, 1), (7, 3), (8, 1), (8, 3)]


@pytest.mark.parametrize("step", [1, 127, 128, 2**40])
def test_batch_bytes_are_the_batch_protobuf_makes_with_the_step_set_at_write_time(step):
    rng = np.random.default_rng(3)
    bits = tensor_codec.float32_to_bfloat16_bits(rng.normal(size=(3, 8)).astype(np.float32))
    blocks = [
        activations.Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, bits, ["a", "b", "a"], np.array([4, 4, 5]),
                          np.array([True, False, True]), "bfloat16"),
        activations.Block("q", types_pb.TENSOR_TYPE_MLP_OUT, 2, rng.normal(size=(2, 8)).astype(np.float32), ["c", "a"],
                          np.array([9, 5]), np.array([True, True]), "bfloat16"),  # rounded to bfloat16
        activations.Block("r", types_pb.TENSOR_TYPE_ATTN_OUT, 3, rng.normal(size=(2, 300)), ["c", "a"],
                          np.array([9, 5]), np.array([True, True])),  # float64, a 2-byte length
        activations.Block("z", types_pb.TENSOR_TYPE_FINAL_NORM, 4, np.zeros((0, 8), np.float32), [], np.zeros(0, np.int64),
                          np.zeros(0, bool)),
    ]
    packed = activations.batch_bytes(blocks)
    wire = activations.session_request_bytes(packed, step)
    message = session_pb.SessionRequest.FromString(wire)
    assert message.WhichOneof("message") == "batch"
    assert message.batch == activations.to_batch(blocks, step=step)
    assert packed.nbytes == len(b"".join(packed.pieces)) == activations.to_batch(blocks).ByteSize()


def test_batch_with_bad_request_index_is_refused_with_the_block_named():
    batch = activations.to_batch(
        [activations.Block("p", types_pb.TENSOR_TYPE_MLP_OUT, 2, np.zeros((1, 4), np.float32), ["a"], np.array([0]), np.array([False]))]
    )
    batch.blocks[0].request_index[0] = 5
    with pytest.raises(activations.BatchDecodeError, match=r"blocks\[0\] \(p@2\).request_index"):
        activations.from_batch(batch)


@pytest.mark.parametrize("shape, reason", [
    ([2**32, 2**32], "needs 73786976294838206464"),  # wraps to 0 elements in int64
    ([2**31, 2**31, 4], "needs 73786976294838206464"),
    ([0, 2**62], "array is too big"),  # 0 elements, but numpy cannot index the shape
    ([-1, 4], "negative dimension"),
])
def test_shapes_that_overflow_are_refused_as_decode_errors(shape, reason):
    message = types_pb.Tensor(dtype="float32", shape=shape, data=b"")
    with pytest.raises(tensor_codec.TensorDecodeError, match=reason):
        tensor_codec.decode(message)
    batch = types_pb.ActivationBatch(request_ids=["r"], blocks=[types_pb.ActivationBlock(point="p", rows=message)])
    with pytest.raises(activations.BatchDecodeError, match=r"blocks\[0\] \(p@0\)\.rows"):
        activations.BatchReader(batch).block(0)


def test_unknown_enum_values_are_named_with_their_field_path():
    from common.enum_checks import check_enums, unknown_enum
    from common.errors import InvalidArgument

    assert unknown_enum(engine_pb.GenerateRequest(probes=[types_pb.ProbeBinding(failure_policy=2, action=2)])) is None
    assert unknown_enum(engine_pb.GenerateRequest(probes=[types_pb.ProbeBinding(), types_pb.ProbeBinding(failure_policy=9)])) == (
        "probes[1].failure_policy: 9 is not a FailurePolicy")
    nested = engine_pb.GenerateRequest(extraction_points=[types_pb.ExtractionPoint(tokens=types_pb.TokenSelector(scope=7))])
    assert unknown_enum(nested) == "extraction_points[0].tokens.scope: 7 is not a TokenSelector.Scope"
    assert unknown_enum(types_pb.ModelInfo(tensor_types=[1, 8]), "hello.model") == (
        "hello.model.tensor_types[1]: 8 is not a TensorType")
    with pytest.raises(InvalidArgument, match=r"probes\[0\]\.action: 3 is not a ProbeAction"):
        check_enums(engine_pb.GenerateRequest(probes=[types_pb.ProbeBinding(action=3)]))


def test_worker_part_round_trip_keeps_bfloat16_as_bits():
    """Workers ship parts to the engine with the same codec; bf16 is never widened there."""
    rows = np.array([[1.5, -2.0], [0.25, 3.0]], dtype=np.float32)
    bits = (rows.view(np.uint32) >> 16).astype(np.uint16)
    for array, dtype in ((rows, "float32"), (bits, "bfloat16")):
        block = activations.Block("p", types_pb.TENSOR_TYPE_MLP_OUT, 2, array, ["a", "b"], np.array([4, 0]),
                                  np.array([True, False]), dtype)
        got = activations.decode_part(activations.encode_part(block))
        assert (got.point, got.tensor_type, got.layer, got.wire_dtype) == ("p", types_pb.TENSOR_TYPE_MLP_OUT, 2, dtype)
        assert got.request_ids == ["a", "b"] and got.token_positions.tolist() == [4, 0]
        assert got.is_generated.tolist() == [True, False]
        assert got.rows.dtype == array.dtype
        np.testing.assert_array_equal(got.rows, array)
        # And on to the router: the batch carries the same bits, decoded exactly.
        (decoded,) = activations.from_batch(activations.to_batch([got]))
        np.testing.assert_array_equal(decoded.rows, rows)  # these values are exact in bfloat16


def test_unknown_dtype_is_refused_when_encoding():
    with pytest.raises(tensor_codec.TensorDecodeError, match="'int8' is not one of"):
        tensor_codec.encode(np.zeros(2, np.int8))


def test_decoded_parts_share_key_objects_only_with_equal_keys():
    """A step's parts mostly carry one key set; decode_parts shares its objects so
    per-step work over keys runs once per key set (ByIdentity), never across sets."""
    rows = np.zeros((2, 3), np.float32)

    def part(layer, ids, positions):
        return activations.encode_part(activations.Block(
            "p", types_pb.TENSOR_TYPE_MLP_OUT, layer, rows, ids, np.array(positions), np.array([True, True])))

    a, b, c, d = activations.decode_parts([
        part(0, ["x", "y"], [4, 4]), part(1, ["x", "y"], [4, 4]), part(2, ["x", "y"], [4, 5]), part(3, ["x", "y"], [4, 5])])
    assert a.request_ids is b.request_ids and a.token_positions is b.token_positions
    assert c.token_positions is not b.token_positions and c.token_positions is d.token_positions
    assert [blk.token_positions.tolist() for blk in (a, b, c, d)] == [[4, 4], [4, 4], [4, 5], [4, 5]]
    with pytest.raises(ValueError, match="read-only"):
        a.token_positions[0] = 7  # one block's keys cannot change another's

    calls = []
    lengths = activations.ByIdentity(lambda ids: calls.append(ids) or len(ids))
    assert [lengths(blk.request_ids) for blk in (a, b, c, d)] == [2, 2, 2, 2]
    assert lengths(["x", "y"]) == 2  # equal, not the same object: computed again
    assert len(calls) == 3  # a/b's list, c/d's list (decoded again: keys differ), the literal
