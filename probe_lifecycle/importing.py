"""Import capture files as a labelled dataset, ready for `train`.

    python -m probe_lifecycle import --out DATASET --positive FILE [--positive FILE ...] \
        --negative FILE [--negative FILE ...] [--shard-mb 64]

A capture file is what `undercurrent capture --out FILE` writes (and what every
dataset shard is). Each request of a --positive file becomes an example with
label 1, of a --negative file label 0, its id the engine's request id (a request
that already names its labelled example, as in a dataset shard, keeps it). The
files must come from one model and capture the same points, each a whole token
scope, at the same layers for every tensor type: those become the dataset's
capture spec. Importing again into the same directory adds what is missing.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
from google.protobuf import json_format

from common.capture_spec import TokenSelector
from probe_lifecycle.cli import OneLineParser, fail
from probe_lifecycle.dataset import (
    MODEL_IDENTITY, POOLINGS, SCOPES, DatasetError, DatasetSpec, DatasetWriter, ExampleRows,
    feature_of,
)
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import capture_file
from undercurrent_client.capture_file import CaptureFile, CaptureFileError, LabelledExample

LABELS = {"--positive": 1, "--negative": 0}


def spec_of(capture: CaptureFile) -> DatasetSpec:
    """The dataset spec whose extraction points the file's points are; refuses a
    file no spec describes, naming the point."""
    where = f"{capture.path}: {capture_file.METADATA_KEY}.points"
    if not capture.points:
        raise DatasetError(f"{where}: empty; the file captured nothing")
    first = capture.points[0]
    layers: dict[str, set[int]] = {}
    for i, point in enumerate(capture.points):
        if (point.tokens, point.pooling) != (first.tokens, first.pooling):
            raise DatasetError(
                f"{where}[{i}]: tokens {point.tokens} pooled {point.pooling!r}, but "
                f"{first.name!r} has {first.tokens} pooled {first.pooling!r}; a dataset selects "
                "the same tokens at every point")
        held = layers.setdefault(point.tensor_type, set())
        if held & set(point.layers):
            raise DatasetError(f"{where}[{i}]: {point.tensor_type} layer(s) "
                               f"{sorted(held & set(point.layers))} are captured by another point too")
        held.update(point.layers)
    decoder = {t: sorted(v) for t, v in layers.items() if t != "final_norm"}
    if len({tuple(v) for v in decoder.values()}) > 1:
        raise DatasetError(f"{where}: layers differ by tensor type ({decoder}); a dataset holds "
                           "the same layers of every tensor type")
    spec = DatasetSpec(tuple(layers), tuple(next(iter(decoder.values()), ())),
                       first.tokens.get("scope", ""), first.pooling,
                       max((r.generated_tokens for r in capture.requests), default=0))
    known = spec.scope in SCOPES and spec.pooling in POOLINGS
    if not known or first.tokens != TokenSelector.from_proto(spec.points()[0].tokens).to_dict():
        raise DatasetError(
            f"{where}[0].tokens: {first.tokens} pooled {first.pooling!r} is not a whole scope "
            "(prompt, generated or all) as a dataset captures it")
    return spec


def _check_same_source(first: CaptureFile, other: CaptureFile, spec: DatasetSpec,
                       other_spec: DatasetSpec) -> None:
    for name in MODEL_IDENTITY:
        if first.model.get(name) != other.model.get(name):
            raise DatasetError(
                f"{other.path}: {capture_file.METADATA_KEY}.model.{name}: {other.model.get(name)!r}, "
                f"but {first.path} has {first.model.get(name)!r}; a dataset holds one model")
    mine = (sorted(other_spec.tensor_types), other_spec.layers, other_spec.scope, other_spec.pooling)
    theirs = (sorted(spec.tensor_types), spec.layers, spec.scope, spec.pooling)
    if mine != theirs:
        raise DatasetError(
            f"{other.path}: {capture_file.METADATA_KEY}.points: capture {mine[0]} at layers "
            f"{list(mine[1])}, tokens {mine[2]!r} pooled {mine[3]!r}, but {first.path} captures "
            f"{theirs[0]} at layers {list(theirs[1])}, tokens {theirs[2]!r} pooled {theirs[3]!r}")


def labelled(capture: CaptureFile, label: int) -> list[LabelledExample]:
    """The example each request of the file becomes: its own, or one named by its request id."""
    examples = []
    for i, request in enumerate(capture.requests):
        example = request.example or LabelledExample(request.request_id, label)
        if example.label != label:
            raise DatasetError(
                f"{capture.path}: {capture_file.METADATA_KEY}.requests[{i}].example.label: "
                f"{example.label}, but the file is imported with label {label}")
        examples.append(example)
    return examples


def examples_of(capture: CaptureFile, examples: list[LabelledExample],
                keys: list[str]) -> Iterator[ExampleRows]:
    """Every request of the file as its labelled example, with its rows of each key."""
    groups = {key: capture.find(*feature_of(key)) for key in keys}
    split = {}
    for key, group in groups.items():
        order = np.lexsort((group.positions, group.request_index))
        bounds = np.searchsorted(group.request_index[order], np.arange(len(capture.requests) + 1))
        split[key] = (group, order, bounds)
    for i, (request, example) in enumerate(zip(capture.requests, examples)):
        features, positions, generated = {}, None, None
        for key, (group, order, bounds) in split.items():
            mine = order[bounds[i]:bounds[i + 1]]
            if positions is None:
                positions, generated = group.positions[mine], group.is_generated[mine]
            elif not np.array_equal(group.positions[mine], positions):
                raise DatasetError(
                    f"{capture.path}: {capture_file.METADATA_KEY}.requests[{i}] "
                    f"({request.request_id!r}): {key} holds other token positions than {keys[0]}")
            features[key] = group.rows[mine]
        yield ExampleRows(replace(request, example=example), features, positions, generated)


def import_captures(files: list[tuple[str | Path, int]], out: str | Path,
                    shard_bytes: int = 64 << 20) -> tuple[dict, int]:
    """Writes (or completes) the dataset at `out` from (capture file, label) pairs;
    returns its manifest and how many examples this run added."""
    if {label for _, label in files} != {0, 1}:
        raise DatasetError("--positive, --negative: give files of both labels (a probe is "
                           "trained on positives and negatives)")
    captures = [(capture_file.read(path), label) for path, label in files]
    first = captures[0][0]
    spec = spec_of(first)
    for capture, _ in captures[1:]:
        _check_same_source(first, capture, spec, spec_of(capture))
    spec = replace(spec, max_tokens=max(
        r.generated_tokens for capture, _ in captures for r in capture.requests))
    examples, came_from = [], {}
    for capture, label in captures:
        examples.append(labelled(capture, label))
        for i, example in enumerate(examples[-1]):
            if example.id in came_from:
                raise DatasetError(
                    f"{capture.path}: {capture_file.METADATA_KEY}.requests[{i}]: example id "
                    f"{example.id!r} is also in {came_from[example.id]}")
            came_from[example.id] = capture.path
    model = json_format.ParseDict(first.model, types_pb.ModelInfo(), ignore_unknown_fields=True)
    writer = DatasetWriter.open(out, spec, model, _source(captures), shard_bytes)
    added = 0
    try:
        for (capture, _), labels in zip(captures, examples):
            for rows in examples_of(capture, labels, writer.keys):
                if rows.id not in writer.done:
                    writer.add(rows)
                    added += 1
        manifest = writer.finish()
    finally:
        writer.close()
    return manifest, added


def _source(captures: list[tuple[CaptureFile, int]]) -> dict:
    """The manifest's `source`: every file with its hash and label; `sha256` covers them
    all, so importing other files into the dataset is refused."""
    files = []
    for capture, label in captures:
        with capture.path.open("rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        files.append({"path": str(capture.path), "sha256": digest, "label": label,
                      "examples": len(capture.requests)})
    positives = sum(f["examples"] for f in files if f["label"] == 1)
    negatives = sum(f["examples"] for f in files if f["label"] == 0)
    return {
        "path": ", ".join(f["path"] for f in files),
        "sha256": hashlib.sha256(json.dumps([[f["label"], f["sha256"]] for f in files]).encode()
                                 ).hexdigest(),
        "examples": positives + negatives, "positives": positives, "negatives": negatives,
        "files": files,
    }


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="probe_lifecycle.import", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="dataset directory (created, or completed)")
    for flag, label in LABELS.items():
        parser.add_argument(flag, action="append", default=[], metavar="FILE",
                            help=f"a capture file whose requests have label {label} (repeatable)")
    parser.add_argument("--shard-mb", type=float, default=64.0)
    args = parser.parse_args(argv)
    if args.shard_mb <= 0:
        parser.error(f"--shard-mb: {args.shard_mb} is not positive")
    files = [(path, 1) for path in args.positive] + [(path, 0) for path in args.negative]
    try:
        manifest, added = import_captures(files, args.out, int(args.shard_mb * 2**20))
    except (DatasetError, CaptureFileError) as err:
        fail("probe_lifecycle.import", str(err))
    print(f"dataset {args.out}: {manifest['examples']} examples ({added} imported now; "
          f"{manifest['source']['positives']} positive, {manifest['source']['negatives']} "
          f"negative), {manifest['rows']} rows of {manifest['keys']} in "
          f"{len(manifest['shards'])} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
