"""Train a probe on a captured dataset and write it in the router's format.

    python -m probe_lifecycle.train --dataset DATASET --out PROBE_DIR --name NAME \
        [--kind logistic|mean_difference|trajectory] [--tensor-type T] [--layer L] \
        [--target-fpr 0.05] [--held-out 0.3] [--seed 0] [--action abort|observe] \
        [--aggregation ema:0.5|rolling_mean:4|max_rolling_mean:4] [--engine HOST:PORT] [--force]

PROBE_DIR gets manifest.json and weights.safetensors (what a router loads),
provenance.json (dataset, model, split, metrics), scores.png and
calibration.png. It is written under a temporary name and renamed when
complete, so a failed run leaves nothing at PROBE_DIR.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.capture_spec import TENSOR_TYPES
from probe_lifecycle import plots
from probe_lifecycle.cli import OneLineParser, fail
from probe_lifecycle.dataset import (
    MANIFEST, MODEL_IDENTITY, DatasetError, feature_key, feature_of, load_features, read_manifest,
)
from probe_lifecycle.training import (
    AGGREGATIONS, KINDS, Evaluation, TrainingError, evaluate, example_scores, fit_logistic,
    fit_mean_difference, rows_of, split_by_example,
)
from common.probe_format.manifest import ManifestError
from common.probe_format.files import (
    MANIFEST_FILE, WEIGHTS_FILE, ProbeFileError, encode_safetensors, load_probe_bytes, write_probe,
)
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import AsyncEngineClient, RpcError
from undercurrent_client.capture_file import model_to_dict
from undercurrent_client.connection import from_env

PROVENANCE_FILE = "provenance.json"
SCORES_PNG = "scores.png"
CALIBRATION_PNG = "calibration.png"


@dataclass(frozen=True)
class TrainOptions:
    name: str
    kind: str = "logistic"
    tensor_type: str | None = None
    layer: int | None = None
    target_fpr: float = 0.05
    held_out: float = 0.3
    seed: int = 0
    action: str = "abort"
    c: float = 1.0
    aggregation: tuple[str, float] = ("ema", 0.5)


@dataclass
class TrainResult:
    out: Path
    manifest: dict
    provenance: dict
    held_out: Evaluation
    train_auroc: float


def choose_key(dataset: dict, tensor_type: str | None, layer: int | None, where: str) -> str:
    """The dataset's feature key for the options, or an error listing what it holds."""
    capture = dataset["capture"]
    types = capture["tensor_types"]
    if tensor_type is None:
        if len(types) != 1:
            raise TrainingError(f"--tensor-type: the dataset holds {types}; choose one")
        tensor_type = types[0]
    if tensor_type not in types:
        raise TrainingError(f"--tensor-type: {where} holds {types}, not {tensor_type!r}")
    if tensor_type == "final_norm":
        if layer is not None:
            raise TrainingError("--layer: final_norm has no layer; leave --layer out")
        return feature_key(tensor_type, int(dataset["model"]["num_layers"]))
    layers = capture["layers"]
    if layer is None:
        if len(layers) != 1:
            raise TrainingError(f"--layer: the dataset holds layers {layers}; choose one")
        layer = layers[0]
    if layer not in layers:
        raise TrainingError(
            f"--layer: {where} holds layers {layers} of {tensor_type}, not layer {layer}"
        )
    return feature_key(tensor_type, layer)


def check_same_model(dataset_model: dict, engine_model: types_pb.ModelInfo, where: str) -> None:
    engine = model_to_dict(engine_model)
    for name in MODEL_IDENTITY:
        if dataset_model.get(name) != engine.get(name):
            raise TrainingError(
                f"{where}: model.{name}: the dataset was captured from {dataset_model.get(name)!r}, "
                f"the engine serves {engine.get(name)!r}"
            )


def _token_scope(capture: dict) -> tuple[dict, str]:
    """The manifest's token selector for a dataset, and how faithful calibration is to it."""
    if capture["pooling"] == "all":
        return {"scope": capture["scope"]}, "exact: every scored row, as the router scores them"
    if capture["pooling"] == "last" and capture["scope"] == "prompt":
        return {"scope": "prompt", "indexes": [-1]}, "exact: the last prompt token"
    return {"scope": capture["scope"]}, (
        f"approximate: calibrated on {capture['pooling']}-pooled rows, but the router scores "
        "every row of the scope; capture with --pooling all for an exact false-positive rate"
    )


def _manifest(options: TrainOptions, dataset: dict, key: str, tokens: dict) -> dict:
    tensor_type, layer = feature_of(key)
    manifest = {
        "name": options.name,
        "version": "0",
        "kind": options.kind,
        "tensor_type": tensor_type,
        "hidden_size": int(dataset["model"]["hidden_size"]),
        "dtype": "float32",
        "threshold": 0.0,
        "action": options.action,
        "tokens": tokens,
    }
    if tensor_type != "final_norm":
        manifest["layers"] = [int(layer)]
    if options.kind == "logistic":
        manifest["output"] = "sigmoid"
    if options.kind == "trajectory":
        aggregation, value = options.aggregation
        parameter = "alpha" if aggregation == "ema" else "window"
        manifest["base"] = {"kind": "logistic", "output": "raw"}
        manifest["aggregation"] = {
            "kind": aggregation, parameter: value if aggregation == "ema" else int(value)
        }
    return manifest


def train_probe(dataset_dir: str | Path, out: str | Path, options: TrainOptions,
                engine_model: types_pb.ModelInfo | None = None, force: bool = False) -> TrainResult:
    dataset_dir, out = Path(dataset_dir), Path(out)
    if options.kind not in KINDS:
        raise TrainingError(f"--kind: {options.kind!r} is not one of {list(KINDS)}")
    if out.exists() and not force:
        raise TrainingError(f"--out: {out} exists; pass --force to replace it")
    dataset = read_manifest(dataset_dir)
    where = str(dataset_dir / MANIFEST)
    if engine_model is not None:
        check_same_model(dataset["model"], engine_model, where)
    key = choose_key(dataset, options.tensor_type, options.layer, where)
    if options.kind == "trajectory" and dataset["capture"]["pooling"] != "all":
        raise TrainingError(
            f"--kind trajectory: needs every token's row, but {where} has capture.pooling "
            f"{dataset['capture']['pooling']!r}; capture with --pooling all"
        )
    _, features = load_features(dataset_dir, key)
    split = split_by_example(features, options.held_out, options.seed)
    fit_rows = rows_of(features, split.train)
    x, y = features.rows[fit_rows], features.labels[features.example[fit_rows]]
    if options.kind == "mean_difference":
        tensors = fit_mean_difference(x, y)
    else:
        tensors = fit_logistic(x, y, options.c, options.seed)
    tokens, calibration = _token_scope(dataset["capture"])
    manifest = _manifest(options, dataset, key, tokens)
    weights = encode_safetensors(tensors, "float32")
    manifest["version"] = hashlib.sha256(weights).hexdigest()[:12]
    probe = load_probe_bytes(json.dumps(manifest), weights, source="training")

    held_scores = example_scores(probe, features, split.held_out)
    held_labels = features.labels[split.held_out]
    held = evaluate(held_scores, held_labels, options.target_fpr)
    train_scores = example_scores(probe, features, split.train)
    train_auroc = float(evaluate(train_scores, features.labels[split.train], options.target_fpr).auroc)
    manifest["threshold"] = held.threshold
    manifest["description"] = (
        f"{options.kind} on {key} of {dataset['model']['model']}, trained on {dataset_dir}; "
        f"held-out AUROC {held.auroc:.3f}, TPR {held.tpr:.3f} at FPR {held.fpr:.3f}"
    )
    provenance = {
        "probe": {"name": options.name, "version": manifest["version"], "kind": options.kind},
        "dataset": {
            "path": str(dataset_dir.resolve()),
            "manifest_sha256": hashlib.sha256((dataset_dir / MANIFEST).read_bytes()).hexdigest(),
            "source": dataset["source"],
            "capture": dataset["capture"],
            "feature": key,
            "examples": dataset["examples"],
            "rows": dataset["rows"],
        },
        "model": dataset["model"],
        "training": {
            "split": "by example, stratified", "seed": options.seed, "held_out": options.held_out,
            "train_examples": int(split.train.size), "held_out_examples": int(split.held_out.size),
            "train_rows": int(fit_rows.sum()), "c": options.c if options.kind != "mean_difference" else None,
            "aggregation": manifest.get("aggregation"),
            "held_out_ids": [features.ids[i] for i in split.held_out],
        },
        "metrics": {"held_out": held.to_dict(), "train_auroc": train_auroc,
                    "example_score": "highest score over the example's scored rows",
                    "calibration": calibration},
        "created_unix": int(time.time()),
    }
    _write_atomically(out, force, manifest, tensors, provenance, held_scores, held_labels, held,
                      options.kind)
    return TrainResult(out, manifest, provenance, held, train_auroc)


def _write_atomically(out: Path, force: bool, manifest: dict, tensors: dict, provenance: dict,
                      scores: np.ndarray, labels: np.ndarray, held: Evaluation, kind: str) -> None:
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write_probe(partial, manifest, tensors)  # loads it back: a bad probe fails here
        (partial / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        title = f"{manifest['name']} ({kind}), held-out AUROC {held.auroc:.3f}"
        plots.score_histogram(partial / SCORES_PNG, scores, labels, held.threshold, title)
        plots.calibration_plot(partial / CALIBRATION_PNG, scores, labels, title,
                               probabilities=kind == "logistic")
        if out.exists() and force:
            shutil.rmtree(out)
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


async def _engine_model(address: str) -> types_pb.ModelInfo:
    async with AsyncEngineClient(from_env(address), timeout=30) as engine:
        return await engine.model_info()


def _aggregation(text: str, parser) -> tuple[str, float]:
    kind, _, value = text.partition(":")
    if kind not in AGGREGATIONS or not value:
        parser.error(f"--aggregation: {text!r} is not KIND:VALUE with KIND in {list(AGGREGATIONS)}")
    try:
        number = float(value)
    except ValueError:
        parser.error(f"--aggregation: {value!r} is not a number")
    if kind == "ema" and not 0 < number <= 1:
        parser.error(f"--aggregation: ema alpha {number} is not in (0, 1]")
    if kind != "ema" and (number < 1 or number != int(number)):
        parser.error(f"--aggregation: {kind} window {value!r} is not an integer >= 1")
    return kind, number


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="probe_lifecycle.train", description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True, help="probe directory to write")
    parser.add_argument("--name", required=True, help="probe name, as bound in Generate")
    parser.add_argument("--kind", choices=KINDS, default="logistic")
    parser.add_argument("--tensor-type", choices=TENSOR_TYPES, default=None)
    parser.add_argument("--layer", type=int, default=None)
    parser.add_argument("--target-fpr", type=float, default=0.05)
    parser.add_argument("--held-out", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--action", choices=("abort", "observe"), default="abort")
    parser.add_argument("--c", type=float, default=1.0, help="inverse L2 strength (logistic)")
    parser.add_argument("--aggregation", default="ema:0.5", help="trajectory: ema:ALPHA, "
                        "rolling_mean:WINDOW or max_rolling_mean:WINDOW")
    parser.add_argument("--engine", default=None,
                        help="HOST:PORT: refuse a dataset captured from another model")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    options = TrainOptions(
        name=args.name, kind=args.kind, tensor_type=args.tensor_type, layer=args.layer,
        target_fpr=args.target_fpr, held_out=args.held_out, seed=args.seed, action=args.action,
        c=args.c, aggregation=_aggregation(args.aggregation, parser),
    )
    prog = "probe_lifecycle.train"
    try:
        engine_model = asyncio.run(_engine_model(args.engine)) if args.engine else None
        result = train_probe(args.dataset, args.out, options, engine_model, force=args.force)
    except (DatasetError, TrainingError, ManifestError, ProbeFileError) as err:
        fail(prog, str(err))
    except RpcError as err:  # e.g. the engine is unreachable
        fail(prog, f"--engine {args.engine}: {err.code.name}: {err.details}")
    print(report(result))
    return 0


def report(result: TrainResult) -> str:
    held, training = result.held_out, result.provenance["training"]
    m = result.manifest
    return "\n".join([
        f"probe {m['name']} ({m['kind']}) on {result.provenance['dataset']['feature']}: "
        f"{training['train_examples']} train / {training['held_out_examples']} held-out examples "
        f"(split by prompt)",
        f"held-out AUROC {held.auroc:.3f} (train {result.train_auroc:.3f}); threshold "
        f"{held.threshold:.6g} for target FPR {held.target_fpr:g}: TPR {held.tpr:.3f}, "
        f"FPR {held.fpr:.3f} ({held.positives} positives, {held.negatives} negatives)",
        f"wrote {result.out}: {MANIFEST_FILE} {WEIGHTS_FILE} {PROVENANCE_FILE} {SCORES_PNG} "
        f"{CALIBRATION_PNG}",
    ])


if __name__ == "__main__":
    sys.exit(main())
