"""The extraction-point model: proto round trip, validation messages, token matching."""

import numpy as np
import pytest

from common.capture_spec import (
    ExtractionPoint,
    Scope,
    TokenSelector,
    needs_prompt_positions,
    parse_points,
)
from common.errors import InvalidArgument
from undercurrent.v1 import types_pb2 as types_pb

PROMPT_TOKENS = 5
# Prompt positions 0..4, generated tokens 0..4 at positions 5..9.
POSITIONS = np.arange(10)


def picked(selector: TokenSelector) -> list[int]:
    return POSITIONS[selector.mask(POSITIONS, PROMPT_TOKENS)].tolist()


@pytest.mark.parametrize(
    "selector, expected",
    [
        (TokenSelector(), list(range(10))),
        (TokenSelector(Scope.PROMPT), [0, 1, 2, 3, 4]),
        (TokenSelector(Scope.GENERATED), [5, 6, 7, 8, 9]),
        (TokenSelector(Scope.PROMPT, indexes=(-1,)), [4]),
        (TokenSelector(Scope.PROMPT, indexes=(0, -2)), [0, 3]),
        (TokenSelector(Scope.PROMPT, ranges=((-3, None),)), [2, 3, 4]),
        (TokenSelector(Scope.PROMPT, ranges=((1, -1),)), [1, 2, 3]),
        (TokenSelector(Scope.GENERATED, indexes=(0, 2)), [5, 7]),
        (TokenSelector(Scope.GENERATED, ranges=((3, None),)), [8, 9]),
        (TokenSelector(Scope.GENERATED, ranges=((0, 2),), indexes=(4,)), [5, 6, 9]),
        (TokenSelector(Scope.ALL, indexes=(0, 7)), [0, 7]),
        (TokenSelector(Scope.ALL, ranges=((3, 6),)), [3, 4, 5]),
        (TokenSelector(Scope.ALL, ranges=((8, None),)), [8, 9]),
    ],
)
def test_mask_follows_proto_semantics(selector, expected):
    assert picked(selector) == expected


def test_mask_matches_streamed_positions_one_at_a_time():
    selector = TokenSelector(Scope.GENERATED, ranges=((1, None),))
    streamed = [p for p in range(5, 40) if selector.mask(np.array([p]), PROMPT_TOKENS)[0]]
    assert streamed == list(range(6, 40))


def test_proto_round_trip_keeps_every_field():
    msg = types_pb.ExtractionPoint(
        name="late",
        tensor_type=types_pb.TENSOR_TYPE_MLP_OUT,
        layers=[2, 3],
        tokens=types_pb.TokenSelector(
            scope=types_pb.TokenSelector.SCOPE_PROMPT,
            indexes=[-1, 0],
            ranges=[types_pb.IndexRange(start=1, stop=3), types_pb.IndexRange(start=-2)],
        ),
        stream_to_client=True,
    )
    point = ExtractionPoint.from_proto(msg)
    assert point == ExtractionPoint(
        "late",
        "mlp_out",
        (2, 3),
        TokenSelector(Scope.PROMPT, (-1, 0), ((1, 3), (-2, None))),
        True,
    )
    assert point.to_proto() == msg


def test_unspecified_scope_means_all():
    point = ExtractionPoint.from_proto(
        types_pb.ExtractionPoint(name="p", tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[0])
    )
    assert point.tokens == TokenSelector(Scope.ALL)


def error_of(points, num_layers=4) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_points(points, num_layers)
    return str(info.value)


def rs(name="p", layers=(0,), **tokens):
    return types_pb.ExtractionPoint(
        name=name, tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=list(layers), tokens=types_pb.TokenSelector(**tokens)
    )


def test_layer_out_of_range_names_point_and_field():
    assert (
        error_of([rs("early"), rs("late", layers=[9])])
        == 'extraction_points[1] "late": layers[0]=9 is out of range [0, 4)'
    )


def test_unknown_tensor_type_is_refused():
    msg = types_pb.ExtractionPoint(name="x", tensor_type=types_pb.TENSOR_TYPE_UNSPECIFIED, layers=[0])
    assert error_of([msg]) == (
        'extraction_points[0] "x": tensor_type TENSOR_TYPE_UNSPECIFIED is not one of '
        "['TENSOR_TYPE_RESIDUAL_STREAM', 'TENSOR_TYPE_ATTN_OUT', 'TENSOR_TYPE_MLP_OUT', "
            "'TENSOR_TYPE_FINAL_NORM']"
    )
    msg.tensor_type = 42
    assert "tensor_type 42 is not one of" in error_of([msg])


def test_negative_generated_index_is_refused():
    message = error_of([rs("tail", scope=types_pb.TokenSelector.SCOPE_GENERATED, indexes=[0, -1])])
    assert message.startswith(
        'extraction_points[0] "tail": tokens.indexes[1]=-1 is negative, which only scope PROMPT allows'
    )


def test_negative_range_outside_prompt_scope_is_refused():
    message = error_of([rs("r", scope=types_pb.TokenSelector.SCOPE_ALL, ranges=[types_pb.IndexRange(start=-2)])])
    assert message == (
        'extraction_points[0] "r": tokens.ranges[0]=[-2, end) has a negative bound, '
        "which only scope PROMPT allows"
    )


def test_empty_range_is_refused():
    message = error_of([rs("r", ranges=[types_pb.IndexRange(start=4, stop=4)])])
    assert message == 'extraction_points[0] "r": tokens.ranges[0]=[4, 4) is empty (stop <= start)'


def test_structure_errors():
    assert error_of([rs(layers=[])]) == (
        'extraction_points[0] "p": layers is empty; residual_stream needs at least one'
    )
    assert error_of([rs(layers=[1, 1])]) == 'extraction_points[0] "p": layers[1]=1 is repeated'
    assert error_of([rs(name="")]) == "extraction_points[0]: name is empty"
    assert error_of([rs("a"), rs("a")]) == (
        'extraction_points[1] "a": name is already used by extraction_points[0]'
    )
    norm = types_pb.ExtractionPoint(name="n", tensor_type=types_pb.TENSOR_TYPE_FINAL_NORM, layers=[3])
    assert error_of([norm]).startswith('extraction_points[0] "n": layers must be empty for final_norm')


def test_final_norm_records_carry_layer_num_layers():
    point = parse_points([types_pb.ExtractionPoint(name="n", tensor_type=types_pb.TENSOR_TYPE_FINAL_NORM)], 4)[0]
    assert point.capture_layers(4) == (4,)


def test_prompt_index_outside_prompt_is_refused_at_registration():
    selector = TokenSelector(Scope.PROMPT, indexes=(-6,))
    with pytest.raises(InvalidArgument, match=r"tokens.indexes\[0\]=-6 is outside the prompt of 5 tokens"):
        selector.check_prompt_tokens("p", 5)
    TokenSelector(Scope.PROMPT, indexes=(-5, 4)).check_prompt_tokens("p", 5)


def test_needs_prompt_positions():
    def point(selector):
        return ExtractionPoint("p", "residual_stream", (0,), selector)

    assert needs_prompt_positions([point(TokenSelector())], 5)
    assert needs_prompt_positions([point(TokenSelector(Scope.PROMPT, indexes=(-1,)))], 5)
    assert not needs_prompt_positions([point(TokenSelector(Scope.GENERATED))], 5)
    assert not needs_prompt_positions([point(TokenSelector(Scope.ALL, ranges=((5, None),)))], 5)
    assert needs_prompt_positions([point(TokenSelector(Scope.ALL, indexes=(4,)))], 5)
