"""Activation datasets on disk: capture-file shards, a manifest and a resume log.

Layout of a dataset directory:
  dataset.json         the manifest: format, model (ModelInfo), capture spec,
                       source (path, sha256), label counts, shards, and
                       `complete` (false while a capture is running or was cut off)
  progress.jsonl       one line per committed shard: its file and example ids
  capture.lock         held (flock) by the one capture writing to the directory
  shard-00000.safetensors ...
Each shard is a capture file (undercurrent_client.capture_file): one point per
captured tensor type, named by it, at the spec's layers; one request per example,
whose `example` holds its id, label and input line. A feature key
`<tensor_type>.<layer>` names one group of every shard.

A shard is written to a temporary file and renamed, then its ids are appended
to the log. A shard the log does not name (the process died between the two)
is deleted on resume and its examples captured again, so no row is ever
duplicated or half written.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from common.capture_spec import TENSOR_TYPES, Scope, TokenSelector, tensor_type_to_proto
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import capture_file
from undercurrent_client.capture_file import (
    POOLINGS, CapturedRequest, CaptureFileError, Group, Point, model_to_dict,
)

FORMAT = "undercurrent-dataset/2"
MANIFEST = "dataset.json"
PROGRESS = "progress.jsonl"
LOCK = "capture.lock"
SCOPES = tuple(scope.value for scope in Scope)
MODEL_IDENTITY = ("model", "architecture", "num_layers", "hidden_size", "dtype", "vocab_size")
"""ModelInfo fields that must agree for two captures to be one dataset."""


class DatasetError(ValueError):
    """A dataset that cannot be used or extended; names the file and field."""


def feature_key(tensor_type: str, layer: int) -> str:
    return f"{tensor_type}.{layer}"


def feature_of(key: str) -> tuple[str, int]:
    """(tensor type, layer) of a feature key."""
    tensor_type, layer = key.rsplit(".", 1)
    return tensor_type, int(layer)


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset captures for every example, and how its rows are pooled (not
    common.capture_spec, the extraction points of one request: this builds them)."""

    tensor_types: tuple[str, ...]
    layers: tuple[int, ...]
    scope: str  # a SCOPES key
    pooling: str  # a POOLINGS value
    max_tokens: int  # generated tokens per example

    def check(self, model: types_pb.ModelInfo) -> None:
        """Refuses a spec the engine's model cannot serve, naming the option."""
        for name in self.tensor_types:
            if name not in TENSOR_TYPES:
                raise DatasetError(f"--tensor-type: {name!r} is not one of {list(TENSOR_TYPES)}")
            offered = set(model.tensor_types)
            if offered and tensor_type_to_proto(name) not in offered:
                raise DatasetError(f"--tensor-type: the engine does not offer {name!r}")
        if self.layers and set(self.tensor_types) == {"final_norm"}:
            raise DatasetError("--layers: final_norm has no layer; leave --layers out")
        if not self.layers and set(self.tensor_types) - {"final_norm"}:
            raise DatasetError("--layers: at least one layer is needed")
        for layer in self.layers:
            if not 0 <= layer < model.num_layers:
                raise DatasetError(
                    f"--layers: {layer} is out of range for a model with num_layers "
                    f"{model.num_layers} (valid: 0..{model.num_layers - 1})"
                )
        if self.scope not in SCOPES:
            raise DatasetError(f"--tokens: {self.scope!r} is not one of {list(SCOPES)}")
        if self.pooling not in POOLINGS:
            raise DatasetError(f"--pooling: {self.pooling!r} is not one of {list(POOLINGS)}")
        if self.max_tokens < 1:
            raise DatasetError(f"--max-tokens: {self.max_tokens} is less than 1")
        if self.scope != "prompt" and self.max_tokens < 2:
            raise DatasetError(
                "--max-tokens: generated tokens need --max-tokens >= 2 (the last sampled "
                "token is never fed back through the model, so it has no activations)"
            )

    def keys(self, model: types_pb.ModelInfo) -> list[str]:
        """The feature tensors of every shard, in a fixed order."""
        keys = []
        for name in self.tensor_types:
            layers = (model.num_layers,) if name == "final_norm" else self.layers
            keys.extend(feature_key(name, layer) for layer in layers)
        return keys

    def points(self) -> list[types_pb.ExtractionPoint]:
        """One extraction point per tensor type, streamed back to the caller."""
        selector = TokenSelector(scope=Scope(self.scope)).to_proto()
        if self.scope == "prompt" and self.pooling == "last":
            selector.indexes.append(-1)  # only the row that is kept crosses the wire
        return [
            types_pb.ExtractionPoint(
                name=name,
                tensor_type=tensor_type_to_proto(name),
                layers=[] if name == "final_norm" else list(self.layers),
                tokens=selector,
                stream_to_client=True,
            )
            for name in self.tensor_types
        ]

    def to_dict(self) -> dict:
        return {**asdict(self), "tensor_types": list(self.tensor_types), "layers": list(self.layers)}

    @classmethod
    def from_dict(cls, data: dict) -> "DatasetSpec":
        return cls(
            tuple(data["tensor_types"]), tuple(data["layers"]), data["scope"], data["pooling"],
            int(data["max_tokens"]),
        )


@dataclass
class ExampleRows:
    """One example's request and its captured rows, pooled: the same positions for
    every feature key."""

    request: CapturedRequest  # its `example` is the labelled example it ran
    features: dict[str, np.ndarray]  # key -> float32 [rows, hidden]
    positions: np.ndarray  # int64 [rows]
    generated: np.ndarray  # bool [rows]

    @property
    def id(self) -> str:
        return self.request.example.id

    @property
    def num_rows(self) -> int:
        return int(self.positions.size)

    @property
    def nbytes(self) -> int:
        """Its size in a shard: the rows, and each key's position, request index and flag."""
        return (sum(v.nbytes for v in self.features.values())
                + capture_file.KEY_BYTES * self.num_rows * len(self.features))


@dataclass
class _Progress:
    done: set[str] = field(default_factory=set)
    shards: list[dict] = field(default_factory=list)  # {file, examples, rows}


class DatasetWriter:
    """Appends examples to a dataset directory, shard by shard, resumable."""

    def __init__(self, directory: Path, manifest: dict, progress: _Progress, shard_bytes: int,
                 lock, model: types_pb.ModelInfo, points: list[Point]):
        self.directory = directory
        self._lock = lock
        self.manifest = manifest
        self.keys = manifest["keys"]
        self.model = model
        self.points = points
        self.progress = progress
        self.shard_bytes = shard_bytes
        self._buffer: list[ExampleRows] = []
        self._buffer_bytes = 0

    @classmethod
    def open(cls, directory: str | Path, spec: DatasetSpec, model: types_pb.ModelInfo, source: dict,
             shard_bytes: int) -> "DatasetWriter":
        """Starts a dataset, or resumes one whose manifest agrees with this capture."""
        directory = Path(directory)
        wanted = {
            "format": FORMAT,
            "model": model_to_dict(model),
            "capture": spec.to_dict(),
            "keys": spec.keys(model),
            "source": source,
        }
        manifest_path = directory / MANIFEST
        if not manifest_path.exists() and directory.exists() and any(
            p.name != LOCK for p in directory.iterdir()
        ):
            raise DatasetError(f"{directory}: exists, is not empty and holds no {MANIFEST}")
        directory.mkdir(parents=True, exist_ok=True)
        lock = _lock(directory)
        try:
            if manifest_path.exists():
                existing = read_manifest(directory)
                _check_resumable(manifest_path, existing, wanted)
                progress = _read_progress(directory)
                manifest = existing
            else:
                progress = _Progress()
                manifest = {**wanted, "complete": False}
                _write_json_atomic(manifest_path, manifest)
            points = [Point.of(p, model, pooling=spec.pooling) for p in spec.points()]
            writer = cls(directory, manifest, progress, shard_bytes, lock, model, points)
            writer._remove_orphans()
        except BaseException:
            lock.close()
            raise
        return writer

    def close(self) -> None:
        """Releases the directory for another capture (also released at process exit)."""
        self._lock.close()

    @property
    def done(self) -> set[str]:
        return self.progress.done

    def add(self, rows: ExampleRows) -> None:
        if rows.request.example is None:
            raise DatasetError(f"request {rows.request.request_id!r}: no labelled example")
        if sorted(rows.features) != sorted(self.keys):
            raise DatasetError(
                f"example {rows.id!r}: captured {sorted(rows.features)}, expected {sorted(self.keys)}"
            )
        self._buffer.append(rows)
        self._buffer_bytes += rows.nbytes
        if self._buffer_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Commits the buffered examples as one shard (atomic), then logs their ids."""
        if not self._buffer:
            return
        name = f"shard-{len(self.progress.shards):05d}.safetensors"
        data = capture_file.encode(self.model, self.points, [e.request for e in self._buffer],
                                   _shard_groups(self._buffer, self.keys))
        _write_bytes_atomic(self.directory / name, data)
        entry = {"file": name, "ids": [e.id for e in self._buffer],
                 "rows": sum(e.num_rows for e in self._buffer)}
        with (self.directory / PROGRESS).open("a") as log:
            log.write(json.dumps(entry) + "\n")
            log.flush()
            os.fsync(log.fileno())
        self.progress.shards.append({"file": name, "examples": len(self._buffer), "rows": entry["rows"]})
        self.progress.done.update(entry["ids"])
        self._buffer.clear()
        self._buffer_bytes = 0

    def finish(self) -> dict:
        """Flushes and marks the dataset complete; returns the manifest."""
        self.flush()
        shards = self.progress.shards
        self.manifest.update(
            complete=True,
            shards=shards,
            examples=sum(s["examples"] for s in shards),
            rows=sum(s["rows"] for s in shards),
        )
        _write_json_atomic(self.directory / MANIFEST, self.manifest)
        return self.manifest

    def _remove_orphans(self) -> None:
        logged = {s["file"] for s in self.progress.shards}
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp") or (
                path.name.startswith("shard-") and path.name not in logged
            ):
                path.unlink()


def _lock(directory: Path):
    """An exclusive lock on the directory: two captures into one dataset would interleave."""
    handle = (directory / LOCK).open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise DatasetError(f"{directory}: another capture is writing to it") from None
    return handle


def _shard_groups(examples: list[ExampleRows], keys: list[str]) -> Iterator[Group]:
    """One group per feature key, at the point named by its tensor type."""
    request_index = np.concatenate(
        [np.full(e.num_rows, i, dtype=np.int64) for i, e in enumerate(examples)])
    positions = np.concatenate([e.positions for e in examples])
    generated = np.concatenate([e.generated for e in examples])
    for key in keys:
        tensor_type, layer = feature_of(key)
        yield Group(tensor_type, layer, np.concatenate([e.features[key] for e in examples]),
                    positions, request_index, generated)


def _check_resumable(path: Path, existing: dict, wanted: dict) -> None:
    for name in MODEL_IDENTITY:
        have, want = existing["model"].get(name), wanted["model"].get(name)
        if have != want:
            raise DatasetError(
                f"{path}: model.{name}: the dataset was captured with {have!r}, the engine "
                f"serves {want!r}; capture into a new directory"
            )
    for name, want in wanted["capture"].items():
        have = existing["capture"].get(name)
        if have != want:
            raise DatasetError(
                f"{path}: capture.{name}: the dataset has {have!r}, this capture asks for "
                f"{want!r}; capture into a new directory"
            )
    have_sha, want_sha = existing["source"]["sha256"], wanted["source"]["sha256"]
    if have_sha != want_sha:
        raise DatasetError(
            f"{path}: source.sha256: the dataset was captured from a different version of "
            f"{existing['source']['path']} ({have_sha[:12]}, now {want_sha[:12]})"
        )


def _read_progress(directory: Path) -> _Progress:
    progress = _Progress()
    path = directory / PROGRESS
    if not path.exists():
        return progress
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut off by a crash: its shard is an orphan
        if not (directory / entry["file"]).exists():
            raise DatasetError(f"{path}: shard {entry['file']} is logged but missing")
        progress.shards.append({"file": entry["file"], "examples": len(entry["ids"]),
                                "rows": entry["rows"]})
        progress.done.update(entry["ids"])
    return progress


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _write_json_atomic(path: Path, data: dict) -> None:
    _write_bytes_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing; is {directory} a captured dataset?") from None
    except (OSError, json.JSONDecodeError) as err:
        raise DatasetError(f"{path}: cannot be read: {err}") from None
    if manifest.get("format") != FORMAT:
        raise DatasetError(
            f"{path}: format: {manifest.get('format')!r}, but this version reads {FORMAT!r}; "
            "capture the dataset again into a new directory")
    return manifest


@dataclass
class Features:
    """One feature key of a whole dataset, with every row's example and position."""

    key: str
    rows: np.ndarray  # float32 [n, hidden]
    example: np.ndarray  # int64 [n], index into ids/labels
    position: np.ndarray  # int64 [n]
    ids: list[str]
    labels: np.ndarray  # int64 [examples]


def load_features(directory: str | Path, key: str) -> tuple[dict, Features]:
    """Reads one feature key of a complete dataset; refuses a partial one."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if not manifest.get("complete"):
        raise DatasetError(
            f"{directory / MANIFEST}: complete: false (the capture was interrupted; run it "
            "again with the same arguments to resume)"
        )
    if key not in manifest["keys"]:
        raise DatasetError(
            f"{directory / MANIFEST}: keys: the dataset holds {manifest['keys']}, not {key!r}"
        )
    rows, example, position, ids, labels = [], [], [], [], []
    for group, examples in _shards(directory, manifest, key):
        offset = len(ids)
        rows.append(group.rows)
        example.append(group.request_index + offset)
        position.append(group.positions)
        ids.extend(e.id for e in examples)
        labels.extend(e.label for e in examples)
    hidden = int(manifest["model"]["hidden_size"])
    return manifest, Features(
        key,
        np.concatenate(rows) if rows else np.zeros((0, hidden), np.float32),
        np.concatenate(example) if example else np.zeros(0, np.int64),
        np.concatenate(position) if position else np.zeros(0, np.int64),
        ids,
        np.asarray(labels, dtype=np.int64),
    )


def _shards(directory: Path, manifest: dict, key: str
            ) -> Iterator[tuple[Group, list[capture_file.LabelledExample]]]:
    """Each shard's group of one feature key (only that: a shard may hold many) and
    the labelled example of each of its requests."""
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        try:
            shard_file = capture_file.read(path)
            group = shard_file.find(*feature_of(key))
        except CaptureFileError as err:
            raise DatasetError(str(err)) from None
        examples = [r.example for r in shard_file.requests]
        if None in examples:
            raise DatasetError(f"{path}: {capture_file.METADATA_KEY}.requests"
                               f"[{examples.index(None)}].example: missing; a dataset labels "
                               "every request")
        yield group, examples
