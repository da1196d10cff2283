"""Training on planted activations: the probe the router loads, its threshold and refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.capture_spec import Scope
from probe_lifecycle.deploy import DeployError, check_against_engine
from probe_lifecycle.train import TrainOptions, check_same_model, train_probe
from probe_lifecycle.training import TrainingError, threshold_for_fpr
from common.probe_format.manifest import parse_manifest
from common.probe_format.files import load_probe_path
from tests.lifecycle import synthetic


def test_threshold_admits_exactly_the_target_share_of_negatives():
    negatives = np.linspace(0.1, 1.0, 10)
    threshold = threshold_for_fpr(negatives, 0.2)
    assert (negatives >= threshold).sum() == 2 and threshold > 0.8
    assert (negatives >= threshold_for_fpr(negatives, 0.0)).sum() == 0


@pytest.mark.parametrize("kind", ["logistic", "mean_difference", "trajectory"])
def test_each_kind_trains_a_probe_the_router_loads_unchanged(tmp_path, kind):
    dataset = synthetic.write_dataset(tmp_path / "ds", count=80)
    out = tmp_path / "probe"
    result = train_probe(dataset, out, TrainOptions(name="planted", kind=kind, layer=2,
                                                    target_fpr=0.1))
    assert sorted(p.name for p in out.iterdir()) == [
        "calibration.png", "manifest.json", "provenance.json", "scores.png", "weights.safetensors"]
    for png in ("calibration.png", "scores.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    probe = load_probe_path(out)  # the router's loader
    assert (probe.manifest.kind, probe.manifest.layers, probe.manifest.hidden_size) == (kind, (2,), 16)
    assert probe.manifest.tokens.scope is Scope.GENERATED
    held = result.held_out
    assert probe.manifest.threshold == held.threshold
    assert held.auroc > 0.95 and held.fpr <= 0.1 and held.tpr > 0.8
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["dataset"]["feature"] == "residual_stream.2"
    assert provenance["model"]["model"] == "synthetic"
    assert provenance["metrics"]["held_out"]["auroc"] == held.auroc
    train_ids = set(result.provenance["training"]["held_out_ids"])
    assert len(train_ids) == held.positives + held.negatives == 24


def test_last_prompt_token_pooling_deploys_as_that_token(tmp_path):
    from probe_lifecycle.dataset import DatasetSpec

    dataset = synthetic.write_dataset(tmp_path / "ds", count=40, pooling="last")
    manifest = json.loads((dataset / "dataset.json").read_text())
    manifest["capture"]["scope"] = "prompt"
    (dataset / "dataset.json").write_text(json.dumps(manifest))
    train_probe(dataset, tmp_path / "p", TrainOptions(name="last", layer=1))
    probe = parse_manifest((tmp_path / "p" / "manifest.json").read_text())
    assert probe.tokens.scope is Scope.PROMPT and probe.tokens.indexes == (-1,)
    assert DatasetSpec.from_dict(manifest["capture"]).points()[0].tokens.indexes == [-1]


@pytest.mark.parametrize("options, dataset_args, message", [
    (dict(layer=3), {}, "--layer: {ds}/dataset.json holds layers [1, 2] of residual_stream, not layer 3"),
    (dict(), {}, "--layer: the dataset holds layers [1, 2]; choose one"),
    (dict(layer=1, tensor_type="attn_out"), {}, "--tensor-type: {ds}/dataset.json holds ['residual_stream'], not 'attn_out'"),
    (dict(layer=1, kind="trajectory"), dict(pooling="mean"), "--kind trajectory: needs every token's row"),
    (dict(layer=1), dict(complete=False), "complete: false"),
])
def test_bad_training_input_is_refused_and_leaves_no_probe(tmp_path, options, dataset_args, message):
    dataset = synthetic.write_dataset(tmp_path / "ds", count=20, **dataset_args)
    with pytest.raises((TrainingError, ValueError)) as refused:
        train_probe(dataset, tmp_path / "probe", TrainOptions(name="p", **options))
    assert message.format(ds=dataset) in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_a_dataset_from_another_model_is_refused(tmp_path):
    dataset = synthetic.write_dataset(tmp_path / "ds", count=20)
    other = synthetic.model_info(hidden=32, name="other")
    with pytest.raises(TrainingError) as refused:
        train_probe(dataset, tmp_path / "probe", TrainOptions(name="p", layer=1), engine_model=other)
    assert "dataset.json: model.model: the dataset was captured from 'synthetic', the engine serves 'other'" in str(refused.value)
    assert not (tmp_path / "probe").exists()
    with pytest.raises(TrainingError, match="model.hidden_size"):
        check_same_model(json.loads((dataset / "dataset.json").read_text())["model"],
                         synthetic.model_info(hidden=32), "ds")


def test_an_existing_probe_is_replaced_only_with_force(tmp_path):
    dataset = synthetic.write_dataset(tmp_path / "ds", count=20)
    (tmp_path / "probe").mkdir()
    with pytest.raises(TrainingError, match="exists; pass --force"):
        train_probe(dataset, tmp_path / "probe", TrainOptions(name="p", layer=1))
    train_probe(dataset, tmp_path / "probe", TrainOptions(name="p", layer=1), force=True)
    assert (tmp_path / "probe" / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "probe"]


def test_deploy_refuses_a_probe_whose_hidden_size_is_not_the_engines(tmp_path):
    dataset = synthetic.write_dataset(tmp_path / "ds", count=20)
    train_probe(dataset, tmp_path / "probe", TrainOptions(name="p", layer=1))
    probe = load_probe_path(tmp_path / "probe")
    with pytest.raises(DeployError) as refused:
        check_against_engine(tmp_path / "probe", probe.manifest, synthetic.model_info(hidden=32))
    assert "hidden_size 16 does not match the model's hidden_size 32" in str(refused.value)
