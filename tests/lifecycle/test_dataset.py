"""Dataset directories: atomic shards, the resume log, and refusals that name the field."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from probe_lifecycle.dataset import (
    MANIFEST, PROGRESS, DatasetError, DatasetWriter, load_features, read_manifest,
)
from tests.lifecycle import synthetic
from undercurrent_client import capture_file


def test_shards_hold_every_row_once_in_order(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=20)
    manifest = read_manifest(directory)
    assert manifest["complete"] and manifest["examples"] == 20
    assert manifest["rows"] == 20 * synthetic.TOKENS
    assert len(manifest["shards"]) > 1  # flushed by size
    _, features = load_features(directory, "residual_stream.2")
    assert features.ids == [f"ex{i}" for i in range(20)]
    assert features.labels.tolist() == [i % 2 for i in range(20)]
    assert np.bincount(features.example).tolist() == [synthetic.TOKENS] * 20
    expected = synthetic.example_rows(0, 0, np.random.default_rng(0)).features["residual_stream.2"]
    np.testing.assert_array_equal(features.rows[: synthetic.TOKENS], expected)


def test_resume_drops_uncommitted_shards_and_keeps_logged_ones(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=20, complete=False)
    logged = [json.loads(line) for line in (directory / PROGRESS).read_text().splitlines()]
    # A crash after a shard's rename but before its log line, and one mid-write.
    (directory / "shard-00099.safetensors").write_bytes(b"orphan")
    (directory / "shard-00100.safetensors.tmp").write_bytes(b"half")
    with (directory / PROGRESS).open("a") as log:
        log.write('{"file": "shard-00099.safet')  # cut off by the crash
    writer = DatasetWriter.open(directory, synthetic.spec(), synthetic.model_info(),
                                read_manifest(directory)["source"], shard_bytes=4000)
    assert writer.done == {i for entry in logged for i in entry["ids"]}
    assert not (directory / "shard-00099.safetensors").exists()
    assert not (directory / "shard-00100.safetensors.tmp").exists()


@pytest.mark.parametrize("change, field", [
    (dict(model=synthetic.model_info(hidden=32)), "model.hidden_size: the dataset was captured with 16"),
    (dict(spec=synthetic.spec(layers=(3,))), "capture.layers: the dataset has [1, 2]"),
    (dict(spec=synthetic.spec(pooling="mean")), "capture.pooling: the dataset has 'all'"),
    (dict(sha="f" * 64), "source.sha256: the dataset was captured from a different version"),
])
def test_resuming_with_another_model_spec_or_input_is_refused(tmp_path, change, field):
    directory = synthetic.write_dataset(tmp_path / "ds", count=6, complete=False)
    before = sorted(p.name for p in directory.iterdir())
    source = dict(read_manifest(directory)["source"], sha256=change.get("sha", "0" * 64))
    with pytest.raises(DatasetError) as refused:
        DatasetWriter.open(directory, change.get("spec", synthetic.spec()),
                           change.get("model", synthetic.model_info()), source, 4000)
    assert f"{directory / MANIFEST}: {field}" in str(refused.value)
    assert sorted(p.name for p in directory.iterdir()) == before


def test_a_non_dataset_directory_is_not_written_into(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match="is not empty and holds no dataset.json"):
        synthetic.write_dataset(tmp_path / "ds")
    assert [p.name for p in (tmp_path / "ds").iterdir()] == ["notes.txt"]


def test_a_partial_dataset_is_refused_for_training(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=6, complete=False)
    with pytest.raises(DatasetError, match="complete: false"):
        load_features(directory, "residual_stream.1")


def test_two_captures_never_write_one_directory(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=6, complete=False)
    source = read_manifest(directory)["source"]
    first = DatasetWriter.open(directory, synthetic.spec(), synthetic.model_info(), source, 4000)
    with pytest.raises(DatasetError, match="another capture is writing to it"):
        DatasetWriter.open(directory, synthetic.spec(), synthetic.model_info(), source, 4000)
    first.close()
    DatasetWriter.open(directory, synthetic.spec(), synthetic.model_info(), source, 4000).close()


def test_each_shard_is_a_capture_file_of_the_examples(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=12)
    manifest = read_manifest(directory)
    _, features = load_features(directory, "residual_stream.1")
    first = manifest["shards"][0]
    shard = capture_file.read(directory / first["file"])
    assert shard.model == manifest["model"]
    assert shard.points == [capture_file.Point("residual_stream", "residual_stream", (1, 2),
                                               {"scope": "generated"}, "all", "float32")]
    assert shard.groups == [("residual_stream", 1), ("residual_stream", 2)]
    assert [r.example for r in shard.requests] == [
        capture_file.LabelledExample(f"ex{i}", i % 2, i + 1) for i in range(first["examples"])]
    assert [(r.request_id, r.prompt_tokens, r.generated_tokens) for r in shard.requests] == [
        (f"req-{i}", 10, synthetic.TOKENS + 1) for i in range(first["examples"])]
    group = shard.group("residual_stream", 1)
    rows = first["rows"]
    assert group.rows.shape == (rows, synthetic.HIDDEN)
    np.testing.assert_array_equal(group.rows, features.rows[:rows])
    np.testing.assert_array_equal(group.request_index, features.example[:rows])
    np.testing.assert_array_equal(group.positions, features.position[:rows])
    assert group.is_generated.all()


def test_a_dataset_of_the_older_format_is_refused_naming_the_field(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=6)
    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format": "undercurrent-dataset/1"}))
    message = (f"{directory / MANIFEST}: format: 'undercurrent-dataset/1', but this version reads "
               "'undercurrent-dataset/2'; capture the dataset again into a new directory")
    for attempt in (lambda: load_features(directory, "residual_stream.1"),
                    lambda: DatasetWriter.open(directory, synthetic.spec(), synthetic.model_info(),
                                               manifest["source"], 4000)):
        with pytest.raises(DatasetError) as refused:
            attempt()
        assert str(refused.value) == message


def test_a_shard_of_the_older_layout_is_refused_naming_the_file(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=6)
    shard = directory / read_manifest(directory)["shards"][0]["file"]
    save_file({"residual_stream.1": np.zeros((5, synthetic.HIDDEN), np.float32),
               "example": np.zeros(5, np.int64), "position": np.zeros(5, np.int64),
               "generated": np.ones(5, np.uint8)}, str(shard), metadata={"examples": "[]"})
    with pytest.raises(DatasetError) as refused:
        load_features(directory, "residual_stream.1")
    assert str(refused.value).startswith(
        f"{shard}: metadata 'undercurrent.capture': missing, so not a capture file of format 2")


def test_requests_without_a_labelled_example_are_not_a_dataset(tmp_path):
    directory = synthetic.write_dataset(tmp_path / "ds", count=6)
    shard = directory / read_manifest(directory)["shards"][0]["file"]
    capture = capture_file.read(shard)
    unlabelled = [dataclasses.replace(r, example=None) for r in capture.requests]
    capture_file.write(shard, synthetic.model_info(), capture.points, unlabelled,
                       [capture.group(*g) for g in capture.groups])
    with pytest.raises(DatasetError) as refused:
        load_features(directory, "residual_stream.1")
    assert str(refused.value) == (f"{shard}: undercurrent.capture.requests[0].example: missing; a "
                                  "dataset labels every request")
    example = synthetic.example_rows(0, 1, np.random.default_rng(0))
    example.request.example = None
    writer = DatasetWriter.open(tmp_path / "new", synthetic.spec(), synthetic.model_info(),
                                read_manifest(directory)["source"], 4000)
    with pytest.raises(DatasetError, match="request 'req-0': no labelled example"):
        writer.add(example)
