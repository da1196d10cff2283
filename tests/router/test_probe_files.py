"""Probe files: layouts, weight dtypes, and strict manifest errors that name the field."""

import json

import numpy as np
import pytest

from common.probe_format.files import (
    ProbeFileError, load_probe_bytes, load_probe_path, probe_paths, write_probe, write_probe_file,
)
from common.probe_format.manifest import KINDS
from router_service.registry import ProbeRegistry
from tests.router.helpers import HIDDEN, manifest
from undercurrent.v1 import types_pb2 as types_pb

WEIGHT = np.linspace(-1, 1, HIDDEN)


def test_directory_and_single_file_layouts_load_the_same_probe(tmp_path):
    spec = manifest("tox")
    write_probe(tmp_path / "tox", spec, {"weight": WEIGHT, "bias": np.array([0.25])})
    write_probe_file(tmp_path / "tox2.safetensors", dict(spec, name="tox2"),
                     {"weight": WEIGHT, "bias": np.array([0.25])})
    assert probe_paths(tmp_path) == [tmp_path / "tox", tmp_path / "tox2.safetensors"]
    a, b = (load_probe_path(p) for p in probe_paths(tmp_path))
    assert (a.name, b.name) == ("tox", "tox2")
    np.testing.assert_array_equal(a.forms[0].weight, b.forms[0].weight)
    assert a.forms[0].bias == b.forms[0].bias == 0.25


def test_bfloat16_weights_round_to_nearest_even(tmp_path):
    write_probe(tmp_path / "p", manifest("p", dtype="bfloat16"), {"weight": np.full(HIDDEN, 1.00390625)})
    # 1 + 2**-8 is halfway between two bfloat16 values; the even one is 1.0.
    assert load_probe_path(tmp_path / "p").forms[0].weight.tolist() == [1.0] * HIDDEN


def test_inline_bytes_load_like_files(tmp_path):
    path = write_probe(tmp_path / "p", manifest("p"), {"weight": WEIGHT})
    probe = load_probe_bytes((path / "manifest.json").read_text(), (path / "weights.safetensors").read_bytes())
    assert probe.manifest.layers == (1,) and probe.source == "inline"


BAD_MANIFESTS = [
    ({"kind": "svm"}, "manifest.kind: 'svm' is not one of"),
    ({"layers": []}, "manifest.layers: at least one layer is needed"),
    ({"layers": [1, -2]}, "manifest.layers[1]: -2 is not a layer index >= 0"),
    ({"layer": 1}, "manifest: set either layer or layers, not both"),
    ({"hidden_size": "16"}, "manifest.hidden_size: expected int, got str '16'"),
    ({"threshold": None}, "manifest.threshold: expected number, got NoneType None"),
    ({"action": "kill"}, "manifest.action: 'kill' is not one of ['observe', 'abort']"),
    ({"tensor_type": "resid"}, "manifest.tensor_type: 'resid' is not one of"),
    ({"dtype": "int8"}, "manifest.dtype: 'int8' is not one of ['float32', 'float16', 'bfloat16']"),
    ({"rule": {"patience": 0}}, "manifest.rule.patience: 0 is less than 1"),
    ({"rule": {"patiense": 2}}, "manifest.rule: unknown field(s) ['patiense']"),
    ({"tokens": {"scope": "generated", "indexes": [-1]}}, "manifest.tokens.indexes[0]: -1 must be"),
    ({"thresold": 0.5}, "manifest: unknown field(s) ['thresold']"),
    ({"output": "softmax"}, "manifest.output: 'softmax' is not one of ['raw', 'sigmoid']"),
]


@pytest.mark.parametrize("change, message", BAD_MANIFESTS)
def test_malformed_manifest_is_refused_with_the_field_named(tmp_path, change, message):
    write_probe(tmp_path / "bad", manifest("bad"), {"weight": WEIGHT})
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps(manifest("bad") | change))
    with pytest.raises(ProbeFileError) as err:
        load_probe_path(tmp_path / "bad")
    assert str(err.value).startswith(f"{tmp_path / 'bad'}: ")
    assert message in str(err.value)


def test_missing_required_field(tmp_path):
    spec = manifest("bad")
    del spec["hidden_size"]
    write_probe(tmp_path / "bad", spec, {"weight": WEIGHT}, check=False)
    with pytest.raises(ProbeFileError, match=r"manifest.hidden_size: missing"):
        load_probe_path(tmp_path / "bad")


def test_not_json(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{kind: linear")
    with pytest.raises(ProbeFileError, match=r"manifest is not valid JSON"):
        load_probe_path(tmp_path / "bad")


@pytest.mark.parametrize(
    "spec_change, tensors, message",
    [
        ({}, {"weight": np.ones(HIDDEN + 1)}, "tensor 'weight' has shape [17], expected [16]"),
        ({}, {}, "tensor 'weight' is missing for a logistic probe"),
        ({}, {"weight": WEIGHT, "w2": WEIGHT}, "tensor(s) ['w2'] are not used by a logistic probe"),
        ({}, {"weight": WEIGHT, "mean": WEIGHT}, "standardisation needs both 'mean' and 'std'"),
        ({}, {"weight": WEIGHT, "mean": WEIGHT, "std": WEIGHT}, "tensor 'std' has values <= 0"),
        ({"kind": "mean_difference"}, {"direction": np.zeros(HIDDEN)}, "tensor 'direction' is all zeros"),
    ],
)
def test_weights_that_do_not_fit_the_manifest(tmp_path, spec_change, tensors, message):
    write_probe(tmp_path / "bad", manifest("bad") | spec_change, tensors, check=False)
    with pytest.raises(ProbeFileError) as err:
        load_probe_path(tmp_path / "bad")
    assert message in str(err.value)


def test_weight_dtype_must_match_the_manifest(tmp_path):
    write_probe(tmp_path / "bad", manifest("bad", dtype="float16"), {"weight": WEIGHT})
    spec = json.loads((tmp_path / "bad" / "manifest.json").read_text()) | {"dtype": "float32"}
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps(spec))
    with pytest.raises(ProbeFileError, match=r"tensor 'weight' is stored as F16, but manifest.dtype is 'float32'"):
        load_probe_path(tmp_path / "bad")


def test_cascade_manifest_rules(tmp_path):
    spec = manifest("c", "cascade", k=3, members=[{"name": "a", "kind": "norm", "threshold": 1},
                                                  {"name": "b", "kind": "norm", "threshold": 2}])
    with pytest.raises(ProbeFileError, match=r"manifest.threshold: a cascade fires on k agreeing members"):
        write_probe(tmp_path / "c", spec)
    del spec["threshold"]
    with pytest.raises(ProbeFileError, match=r"manifest.k: 3 is more than the 2 members"):
        write_probe(tmp_path / "c", spec)


def test_missing_paths(tmp_path):
    with pytest.raises(ProbeFileError, match=r"no such file or directory"):
        load_probe_path(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ProbeFileError, match=r"no manifest.json in the probe directory"):
        load_probe_path(tmp_path / "empty")


# A probe of every kind the router implements, with the tensors it needs.
EVERY_KIND = {
    "linear": ({}, {"weight": WEIGHT}),
    "logistic": ({}, {"weight": WEIGHT}),
    "mean_difference": ({}, {"direction": WEIGHT}),
    "norm": ({}, {}),
    "trajectory": ({"base": {"kind": "norm"}, "aggregation": {"kind": "ema", "alpha": 0.5}}, {}),
    "cascade": ({"k": 1, "members": [{"name": "a", "kind": "norm", "threshold": 1.0},
                                     {"name": "b", "kind": "norm", "threshold": 2.0}]}, {}),
}


def test_every_kind_is_described_by_its_probe_kind_and_the_contract_has_no_other(tmp_path):
    registry = ProbeRegistry()
    for kind, (fields, tensors) in EVERY_KIND.items():
        spec = manifest(kind, kind, **fields)
        if kind == "cascade":
            del spec["threshold"]  # a cascade's threshold is its k
        registry.load(load_probe_path(write_probe(tmp_path / kind, spec, tensors)))
    described = {p.name: types_pb.ProbeKind.Name(registry.info(p).kind) for p in registry.probes()}
    assert described == {
        "linear": "PROBE_KIND_LINEAR", "logistic": "PROBE_KIND_LOGISTIC",
        "mean_difference": "PROBE_KIND_MEAN_DIFFERENCE", "norm": "PROBE_KIND_NORM",
        "trajectory": "PROBE_KIND_TRAJECTORY", "cascade": "PROBE_KIND_CASCADE",
    }
    assert set(EVERY_KIND) == set(KINDS)  # every kind of the format was loaded above
    assert set(described.values()) == set(types_pb.ProbeKind.keys()) - {"PROBE_KIND_UNSPECIFIED"}
