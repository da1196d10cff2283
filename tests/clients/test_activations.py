"""Activation helpers and the capture file, on batches packed by the services' own
encoder (common.activations.to_batch)."""

import json
import re

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from common.activations import Block, to_batch
from common.capture_spec import Scope, TokenSelector
from common.tensor_codec import float32_to_bfloat16_bits
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import ActivationKey, ActivationSet, batch_arrays, generate_request, point
from undercurrent_client import capture_file
from undercurrent_client.events import Activations, Finished, Generation, event_of

RESIDUAL = types_pb.TENSOR_TYPE_RESIDUAL_STREAM


def block(point_name, layer, rows, request_ids, positions, generated, wire_dtype):
    return Block(point_name, RESIDUAL, layer, np.asarray(rows, np.float32), list(request_ids),
                 np.asarray(positions, np.int64), np.asarray(generated, bool), wire_dtype)


@pytest.mark.parametrize("wire_dtype", ["float32", "float16", "bfloat16"])
def test_batch_arrays_keys_every_row_and_decodes_each_dtype(wire_dtype):
    rows = np.array([[1.5, -2.25, 3.0], [0.125, 65504.0 if wire_dtype == "float16" else 1e30, -0.0],
                     [7.0, 8.0, 9.0]], np.float32)
    batch = to_batch([block("p", 3, rows, ["a", "b", "a"], [4, 2, 5], [False, True, True], wire_dtype)])
    arrays = batch_arrays(batch)
    assert list(arrays) == [ActivationKey("a", "p", 3, 4), ActivationKey("b", "p", 3, 2),
                            ActivationKey("a", "p", 3, 5)]
    if wire_dtype == "bfloat16":
        expected = (float32_to_bfloat16_bits(rows).astype(np.uint32) << 16).view(np.float32)
    else:
        expected = rows.astype(wire_dtype).astype(np.float32)
    for i, key in enumerate(arrays):
        assert arrays[key].dtype == np.float32
        np.testing.assert_array_equal(arrays[key], expected[i])


def test_activation_set_groups_requests_and_orders_tokens():
    first = to_batch([block("p", 1, [[1, 1], [2, 2]], ["a", "b"], [5, 5], [True, True], "float32"),
                      block("p", 2, [[3, 3]], ["a"], [5], [True], "float32")])
    second = to_batch([block("p", 1, [[4, 4], [0, 0]], ["a", "a"], [6, 1], [True, False], "float32")])
    gathered = ActivationSet([second, first])
    assert len(gathered) == 5
    assert gathered.groups() == [("a", "p", 1), ("a", "p", 2), ("b", "p", 1)]
    positions, rows, generated = gathered.matrix("a", "p", 1)
    assert positions.tolist() == [1, 5, 6]
    assert rows.tolist() == [[0, 0], [1, 1], [4, 4]]
    assert generated.tolist() == [False, True, True]
    with pytest.raises(KeyError, match="'zzz'"):
        gathered.matrix("zzz", "p", 1)
    with pytest.raises(ValueError, match="arrived twice"):
        gathered.add(first)


def test_malformed_batch_names_the_block_and_field():
    batch = to_batch([block("p", 1, [[1, 2]], ["a"], [0], [False], "float32")])
    batch.blocks[0].rows.data = batch.blocks[0].rows.data[:-1]
    with pytest.raises(ValueError, match=r"blocks\[0\] \(p@1\)\.rows: tensor.data has 7 bytes"):
        batch_arrays(batch)


def test_point_specs_parse_or_name_the_problem():
    p = point("residual_stream:12")
    assert (p.name, p.tensor_type, list(p.layers), p.stream_to_client) == (
        "residual_stream:12", RESIDUAL, [12], True)
    assert list(point("mlp_out:0,2").layers) == [0, 2]
    assert point("final_norm").tensor_type == types_pb.TENSOR_TYPE_FINAL_NORM
    for spec, message in [("resid:1", "tensor type 'resid'"), ("mlp_out", "give a layer"),
                          ("attn_out:x", "layers must be integers"), ("final_norm:3", "takes no layer")]:
        with pytest.raises(ValueError, match=message):
            point(spec)


def test_generate_request_sets_only_what_is_given():
    request = generate_request([1, 2, 3], max_tokens=5, temperature=0.0, probes=["a"], gate_tokens=True)
    assert list(request.token_ids.ids) == [1, 2, 3] and request.gate_tokens
    assert request.sampling.HasField("temperature") and not request.sampling.HasField("top_p")
    assert [(b.probe, b.failure_policy, b.action) for b in request.probes] == [("a", 0, 0)]
    text = generate_request("hi", max_activation_message_bytes=1 << 20)
    assert text.text == "hi" and not text.sampling.HasField("temperature")
    assert text.max_activation_message_bytes == 1 << 20
    # Unset, gating is the operator's guards' to decide; false is a choice a gating guard refuses.
    assert not text.HasField("gate_tokens")
    assert generate_request("hi", gate_tokens=False).HasField("gate_tokens")


def test_events_are_typed_and_gathered():
    batch = to_batch([block("p", 1, [[1, 2]], ["r"], [3], [True], "float32")])
    responses = [
        engine_pb.GenerateResponse(started=engine_pb.GenerateStarted(request_id="r", prompt_tokens=3)),
        engine_pb.GenerateResponse(tokens=engine_pb.TokenChunk(token_ids=[7, 8], text="ab", first_index=0)),
        engine_pb.GenerateResponse(activations=batch),
        engine_pb.GenerateResponse(probe_event=engine_pb.ProbeEvent(scores=types_pb.ProbeScores(
            probe="q", token_positions=[3], scores=[0.5], router="x:1"))),
        engine_pb.GenerateResponse(finished=engine_pb.GenerateFinished(
            finish_reason=types_pb.FINISH_REASON_PROBE_ABORT, generated_tokens=2, prompt_tokens=3,
            verdict=types_pb.Verdict(probe="q", score=0.9, token_position=4, reason="fired"))),
    ]
    events = [event_of(r) for r in responses]
    assert isinstance(events[2], Activations) and isinstance(events[4], Finished)
    generation = Generation.of(events)
    assert (generation.request_id, generation.token_ids, generation.text) == ("r", [7, 8], "ab")
    assert generation.probe_scores("q") == {3: 0.5}
    assert generation.reason == "PROBE_ABORT" and generation.finished.verdict.token_position == 4
    assert list(generation.activations.arrays) == [ActivationKey("r", "p", 1, 3)]
    with pytest.raises(ValueError, match="no known event"):
        event_of(engine_pb.GenerateResponse())


def test_capture_file_round_trips_rows_keys_and_metadata(tmp_path):
    points = [point("residual_stream:1", tokens=TokenSelector(Scope.GENERATED).to_proto())]
    name = points[0].name
    gathered = ActivationSet([
        to_batch([block(name, 1, [[1, 2], [3, 4]], ["r0", "r1"], [0, 0], [False, False], "bfloat16")]),
        to_batch([block(name, 1, [[5, 6]], ["r0"], [1], [True], "bfloat16")]),
    ])
    requests = [capture_file.CapturedRequest("r0", "a b", 1, 2, "LENGTH", "xy"),
                capture_file.CapturedRequest("r1", "c", 1, 1, "LENGTH", "z")]
    model = types_pb.ModelInfo(model="m", num_layers=4, hidden_size=2, dtype="bfloat16")
    records, groups = capture_file.from_activations(gathered, requests, points, model)
    capture_file.write(tmp_path / "c.safetensors", model, records, requests, groups)
    with safe_open(str(tmp_path / "c.safetensors"), framework="numpy") as handle:
        assert sorted(handle.keys()) == sorted(f"{name}/1/{part}" for part in
                                               ("rows", "positions", "request_index", "is_generated"))
        assert handle.get_tensor(f"{name}/1/is_generated").dtype == np.uint8
    capture = capture_file.read(tmp_path / "c.safetensors")
    assert capture.groups == [(name, 1)]
    group = capture.group(name, 1)
    assert group.rows.dtype == np.float32 and group.rows.tolist() == [[1, 2], [5, 6], [3, 4]]
    assert group.positions.tolist() == [0, 1, 0]
    assert group.request_index.tolist() == [0, 0, 1]
    assert group.is_generated.dtype == bool and group.is_generated.tolist() == [False, True, False]
    assert capture.find("residual_stream", 1).rows.tolist() == group.rows.tolist()
    assert capture.model["hidden_size"] == 2 and capture.model["num_layers"] == 4
    assert capture.points == [capture_file.Point(name, "residual_stream", (1,), {"scope": "generated"},
                                                 "all", "bfloat16")]
    assert capture.requests == requests
    metadata = json.loads(handle_metadata(tmp_path / "c.safetensors")["undercurrent.capture"])
    assert metadata["format"] == 2 and "example" not in metadata["requests"][0]


def handle_metadata(path) -> dict:
    with safe_open(str(path), framework="numpy") as handle:
        return handle.metadata()


def test_capture_file_keeps_labelled_examples_and_a_point_without_rows(tmp_path):
    model = types_pb.ModelInfo(model="m", num_layers=4, hidden_size=2, dtype="float16")
    points = [capture_file.Point.of(point("final_norm"), model),
              capture_file.Point.of(point("mlp_out:0,2"), model)]
    assert (points[0].layers, points[0].wire_dtype, points[0].tokens) == ((4,), "float16", {"scope": "all"})
    requests = [capture_file.CapturedRequest("r0", "a", 1, 2, "LENGTH", "x",
                                             capture_file.LabelledExample("ex1", 1, 7)),
                capture_file.CapturedRequest("r1", "b", 1, 2, "LENGTH", "y",
                                             capture_file.LabelledExample("ex2", 0))]
    rows = np.array([[0.1, 65504.0]], np.float16)  # widened exactly
    groups = [capture_file.Group("mlp_out:0,2", 2, rows, np.array([1]), np.array([1]), np.array([True]))]
    capture_file.write(tmp_path / "c.safetensors", model, points, requests, groups)
    capture = capture_file.read(tmp_path / "c.safetensors")
    assert capture.requests == requests
    assert capture.find("mlp_out", 2).rows.tolist() == rows.astype(np.float32).tolist()
    empty = capture.find("mlp_out", 0)
    assert empty.rows.shape == (0, 2) and empty.request_index.size == 0
    with pytest.raises(capture_file.CaptureFileError, match=r"c.safetensors: points: 0 points capture "
                                                            r"attn_out at layer 0, not one"):
        capture.find("attn_out", 0)
    twice = [*points, capture_file.Point.of(point("mlp_out:2", name="again"), model)]
    capture_file.write(tmp_path / "c.safetensors", model, twice, requests, groups)
    with pytest.raises(capture_file.CaptureFileError, match=r"points: 2 points capture mlp_out at "
                                                            r"layer 2, not one"):
        capture_file.read(tmp_path / "c.safetensors").find("mlp_out", 2)


@pytest.mark.parametrize("name, rows, message", [
    ("p", np.zeros((1, 2), np.float64), "group p/1: rows are float64; a capture file holds float32"),
    ("p", np.zeros((2, 2), np.float32), "group p/1/positions: shape [1], but rows has 2 rows"),
    ("q", np.zeros((1, 2), np.float32), "group q/1: no point is named 'q'"),
])
def test_rows_a_capture_file_cannot_hold_are_refused(tmp_path, name, rows, message):
    model = types_pb.ModelInfo(model="m", num_layers=4, hidden_size=2)
    request = capture_file.CapturedRequest("r0", "a", 1, 1, "LENGTH", "")
    group = capture_file.Group(name, 1, rows, np.array([0]), np.array([0]), np.array([False]))
    with pytest.raises(ValueError, match=re.escape(message)):
        capture_file.encode(model, [capture_file.Point("p", "residual_stream", (1,), {}, "all", "")],
                            [request], [group])


def write_raw(path, metadata: dict, tensors=None) -> None:
    save_file(tensors or {"p/1/rows": np.zeros((1, 2), np.float32)}, str(path), metadata=metadata)


@pytest.mark.parametrize("metadata, message", [
    ({"undercurrent.capture": json.dumps({"format": 1, "model": {}, "points": [], "requests": []})},
     "{path}: undercurrent.capture.format: 1, but this version reads format 2; capture it again"),
    ({"examples": "[]"},  # a dataset shard of format undercurrent-dataset/1
     "{path}: metadata 'undercurrent.capture': missing, so not a capture file of format 2 "
     "(held: ['examples'])"),
    ({"undercurrent.capture": "{"}, "{path}: metadata 'undercurrent.capture': not valid JSON"),
    ({"undercurrent.capture": json.dumps({"format": 2, "model": {}, "points": [],
                                          "requests": [{"request_id": "r"}]})},
     "{path}: undercurrent.capture.requests[0].prompt: missing"),
    ({"undercurrent.capture": json.dumps({"format": 2, "model": {}, "points": {}, "requests": []})},
     "{path}: undercurrent.capture.points: expected list, got dict"),
])
def test_an_old_or_broken_capture_file_is_refused_naming_the_file_and_field(tmp_path, metadata, message):
    path = tmp_path / "old.safetensors"
    write_raw(path, metadata)
    with pytest.raises(capture_file.CaptureFileError) as refused:
        capture_file.read(path)
    assert message.format(path=path) in str(refused.value)


def test_a_group_whose_keys_do_not_line_up_is_refused_on_read(tmp_path):
    path = tmp_path / "bad.safetensors"
    metadata = {"format": 2, "model": {"hidden_size": 2}, "requests": [
        {"request_id": "r", "prompt": "", "prompt_tokens": 1, "generated_tokens": 1,
         "finish_reason": "LENGTH", "text": ""}],
        "points": [{"name": "p", "tensor_type": "residual_stream", "layers": [1], "tokens": {},
                    "pooling": "all", "wire_dtype": "float32"}]}
    write_raw(path, {"undercurrent.capture": json.dumps(metadata)}, {
        "p/1/rows": np.zeros((1, 2), np.float32), "p/1/positions": np.zeros(1, np.int64),
        "p/1/request_index": np.array([3], np.int64), "p/1/is_generated": np.zeros(1, np.uint8)})
    with pytest.raises(capture_file.CaptureFileError,
                       match=re.escape(f"{path}: p/1/request_index: an index is out of range of the 1 requests")):
        capture_file.read(path).group("p", 1)
