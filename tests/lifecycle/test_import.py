"""Capture files (what `undercurrent capture` writes) imported as a labelled dataset:
written through the client's own path from batches packed by the services' encoder,
read back by training; refusals name the file and the field before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from common.activations import Block, to_batch
from common.capture_spec import Scope, TokenSelector
from probe_lifecycle.dataset import MANIFEST, DatasetError, DatasetWriter, load_features
from probe_lifecycle.importing import import_captures, main
from probe_lifecycle.train import TrainOptions, train_probe
from tests.lifecycle import synthetic
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import ActivationSet, capture_file, point

HIDDEN = 8
PROMPT, GENERATED = 4, 6  # 5 generated rows a request: the last sampled token has none
GENERATED_SCOPE = TokenSelector(Scope.GENERATED).to_proto()


def model_info(hidden: int = HIDDEN) -> types_pb.ModelInfo:
    return types_pb.ModelInfo(model="tiny", architecture="LlamaForCausalLM", num_layers=4,
                              hidden_size=hidden, dtype="float32", vocab_size=512)


def capture(path, label: int, count: int, prefix: str, specs=("residual_stream:1", "final_norm"),
            tokens=GENERATED_SCOPE, hidden: int = HIDDEN, seed: int = 0, last_point_tokens=None,
            last_point_shift: int = 0):
    """A capture file as `undercurrent capture` writes it: rows of every layer of each
    point at the generated positions (the last point's shifted by `last_point_shift`);
    a positive's rows are shifted along axis 0."""
    rng = np.random.default_rng(seed)
    model = model_info(hidden)
    points = [point(spec, tokens=tokens) for spec in specs]
    if last_point_tokens is not None:
        points[-1].tokens.CopyFrom(last_point_tokens)
    requests = [capture_file.CapturedRequest(f"{prefix}{i}", f"prompt {i}", PROMPT, GENERATED,
                                             "LENGTH", f"text {i}") for i in range(count)]
    blocks = []
    for p in points:
        record = capture_file.Point.of(p, model)
        for layer in record.layers:
            for request in requests:
                rows = rng.normal(size=(GENERATED - 1, hidden)).astype(np.float32)
                rows[:, 0] += 2.0 * label
                positions = np.arange(PROMPT, PROMPT + GENERATED - 1)
                if p is points[-1]:
                    positions = positions + last_point_shift
                blocks.append(Block(p.name, p.tensor_type, layer, rows,
                                    [request.request_id] * len(positions), positions,
                                    np.ones(len(positions), bool)))
    gathered = ActivationSet([to_batch(blocks)])
    records, groups = capture_file.from_activations(gathered, requests, points, model)
    capture_file.write(path, model, records, requests, groups)
    return path


@pytest.fixture
def files(tmp_path):
    return (capture(tmp_path / "pos.safetensors", 1, 12, "p", seed=1),
            capture(tmp_path / "neg.safetensors", 0, 12, "n", seed=2))


def test_capture_files_import_as_a_dataset_that_trains(tmp_path, files):
    positive, negative = files
    manifest, added = import_captures([(positive, 1), (negative, 0)], tmp_path / "ds", 2000)
    assert added == 24 and manifest["complete"] and len(manifest["shards"]) > 1
    assert manifest["capture"] == {"tensor_types": ["residual_stream", "final_norm"], "layers": [1],
                                   "scope": "generated", "pooling": "all", "max_tokens": GENERATED}
    assert manifest["keys"] == ["residual_stream.1", "final_norm.4"]
    assert (manifest["examples"], manifest["rows"]) == (24, 24 * (GENERATED - 1))
    source = manifest["source"]
    assert (source["positives"], source["negatives"]) == (12, 12)
    assert [(f["path"], f["label"], f["examples"]) for f in source["files"]] == [
        (str(positive), 1, 12), (str(negative), 0, 12)]

    _, features = load_features(tmp_path / "ds", "final_norm.4")
    assert features.ids == [f"p{i}" for i in range(12)] + [f"n{i}" for i in range(12)]
    assert features.labels.tolist() == [1] * 12 + [0] * 12
    captured = capture_file.read(negative).group("final_norm", 4)
    negatives = features.example >= 12
    np.testing.assert_array_equal(features.rows[negatives], captured.rows)
    np.testing.assert_array_equal(features.position[negatives], captured.positions)

    trained = train_probe(tmp_path / "ds", tmp_path / "probe",
                          TrainOptions(name="imported", tensor_type="residual_stream"))
    assert trained.provenance["dataset"]["feature"] == "residual_stream.1"
    assert trained.held_out.auroc > 0.95
    assert trained.manifest["tokens"] == {"scope": "generated"}


def test_importing_again_adds_nothing_and_other_files_are_refused(tmp_path, files):
    positive, negative = files
    first, _ = import_captures([(positive, 1), (negative, 0)], tmp_path / "ds", 2000)
    again, added = import_captures([(positive, 1), (negative, 0)], tmp_path / "ds", 2000)
    assert added == 0 and again["shards"] == first["shards"]
    other = capture(tmp_path / "other.safetensors", 0, 3, "o")
    with pytest.raises(DatasetError, match="source.sha256: the dataset was captured from a "
                                           "different version of"):
        import_captures([(positive, 1), (other, 0)], tmp_path / "ds", 2000)


def test_dataset_shards_import_keeping_their_examples(tmp_path):
    shards = []
    for label in (1, 0):
        directory = tmp_path / f"ds{label}"
        writer = DatasetWriter.open(directory, synthetic.spec(), synthetic.model_info(),
                                    {"path": "x.jsonl", "sha256": "0" * 64}, shard_bytes=1 << 20)
        rng = np.random.default_rng(label)
        for i in range(3):
            writer.add(synthetic.example_rows(10 * label + i, label, rng))
        shards.append(directory / writer.finish()["shards"][0]["file"])
    manifest, _ = import_captures([(shards[0], 1), (shards[1], 0)], tmp_path / "merged")
    assert manifest["capture"] == {**synthetic.spec().to_dict(), "max_tokens": synthetic.TOKENS + 1}
    merged = capture_file.read(tmp_path / "merged" / manifest["shards"][0]["file"])
    assert [r.example for r in merged.requests] == [
        capture_file.LabelledExample(f"ex{i}", label, i + 1) for i, label in
        [(10, 1), (11, 1), (12, 1), (0, 0), (1, 0), (2, 0)]]
    with pytest.raises(DatasetError) as refused:
        import_captures([(shards[0], 0), (shards[1], 1)], tmp_path / "swapped")
    assert str(refused.value) == (f"{shards[0]}: undercurrent.capture.requests[0].example.label: 1, "
                                  "but the file is imported with label 0")
    assert not (tmp_path / "swapped").exists()


def write_file(tmp_path, name, label=0, **kwargs):
    return capture(tmp_path / name, label, 3, name[:2], **kwargs)


@pytest.mark.parametrize("make_negative, message", [
    (lambda t: write_file(t, "hidden.safetensors", hidden=16),
     "{neg}: undercurrent.capture.model.hidden_size: 16, but {pos} has 8; a dataset holds one model"),
    (lambda t: write_file(t, "layers.safetensors", specs=("residual_stream:2", "final_norm")),
     "{neg}: undercurrent.capture.points: capture ['final_norm', 'residual_stream'] at layers [2], "
     "tokens 'generated' pooled 'all', but {pos} captures ['final_norm', 'residual_stream'] at "
     "layers [1], tokens 'generated' pooled 'all'"),
    (lambda t: write_file(t, "indexes.safetensors", tokens=types_pb.TokenSelector(
        scope=types_pb.TokenSelector.SCOPE_GENERATED, indexes=[0])),
     "{neg}: undercurrent.capture.points[0].tokens: {{'scope': 'generated', 'indexes': [0]}} pooled "
     "'all' is not a whole scope (prompt, generated or all) as a dataset captures it"),
    (lambda t: write_file(t, "mixed.safetensors", specs=("residual_stream:1", "mlp_out:2")),
     "{neg}: undercurrent.capture.points: layers differ by tensor type ({{'residual_stream': [1], "
     "'mlp_out': [2]}}); a dataset holds the same layers of every tensor type"),
    (lambda t: write_file(t, "twice.safetensors", specs=("residual_stream:1", "residual_stream:1,2")),
     "{neg}: undercurrent.capture.points[1]: residual_stream layer(s) [1] are captured by another "
     "point too"),
    (lambda t: write_file(t, "tokens.safetensors", last_point_tokens=TokenSelector(Scope.ALL).to_proto()),
     "{neg}: undercurrent.capture.points[1]: tokens {{'scope': 'all'}} pooled 'all', but "
     "'residual_stream:1' has {{'scope': 'generated'}} pooled 'all'; a dataset selects the same "
     "tokens at every point"),
    (lambda t: write_file(t, "empty.safetensors", specs=()),
     "{neg}: undercurrent.capture.points: empty; the file captured nothing"),
    (lambda t: capture(t / "same.safetensors", 0, 3, "po"),  # pos.safetensors' ids
     "{neg}: undercurrent.capture.requests[0]: example id 'po0' is also in {pos}"),
])
def test_files_that_are_not_one_dataset_are_refused_before_anything_is_written(
        tmp_path, make_negative, message):
    positive = write_file(tmp_path, "pos.safetensors", label=1)
    negative = make_negative(tmp_path)
    with pytest.raises(DatasetError) as refused:
        import_captures([(positive, 1), (negative, 0)], tmp_path / "ds")
    assert str(refused.value) == message.format(pos=positive, neg=negative)
    assert not (tmp_path / "ds").exists()


def test_the_command_prints_the_dataset_or_one_line_naming_the_file(tmp_path, files, capsys):
    positive, negative = files
    out = tmp_path / "ds"
    assert main(["--positive", str(positive), "--negative", str(negative), "--out", str(out)]) == 0
    assert capsys.readouterr().out == (
        f"dataset {out}: 24 examples (24 imported now; 12 positive, 12 negative), 120 rows of "
        "['residual_stream.1', 'final_norm.4'] in 1 shard(s)\n")
    assert json.loads((out / MANIFEST).read_text())["complete"]

    old = tmp_path / "old.safetensors"
    save_file({"x": np.zeros(1, np.float32)}, str(old),
              metadata={"undercurrent.capture": json.dumps({"format": 1})})
    for argv, message in [
        (["--positive", str(positive), "--negative", str(old)],
         f"{old}: undercurrent.capture.format: 1, but this version reads format 2; capture it again "
         "with this version"),
        (["--positive", str(positive)], "--positive, --negative: give files of both labels"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--out", str(tmp_path / "other")])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"probe_lifecycle.import: error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "other").exists()


def test_a_request_whose_points_saw_other_tokens_leaves_the_dataset_partial(tmp_path):
    positive = write_file(tmp_path, "pos.safetensors", label=1)
    negative = write_file(tmp_path, "neg.safetensors", last_point_shift=1)
    with pytest.raises(DatasetError) as refused:
        import_captures([(positive, 1), (negative, 0)], tmp_path / "ds")
    assert str(refused.value) == (f"{negative}: undercurrent.capture.requests[0] ('ne0'): "
                                  "final_norm.4 holds other token positions than residual_stream.1")
    assert json.loads((tmp_path / "ds" / MANIFEST).read_text())["complete"] is False
