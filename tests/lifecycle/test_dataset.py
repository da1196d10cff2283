"""Dataset directories: atomic shards, the resume log, and refusals that name the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from probe_lifecycle.dataset import (
    MANIFEST, PROGRESS, DatasetError, DatasetWriter, load_features, read_manifest,
)
from tests.lifecycle import synthetic


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
