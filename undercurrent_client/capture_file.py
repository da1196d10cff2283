"""Captured activations as one safetensors file: what `undercurrent capture` writes,
what every shard of a probe_lifecycle dataset is, and what probe training reads.

The layout lives here only, so a file from either writer is read by either reader.
Tensors, for each extraction point P and layer L (a group; its requests stacked in
request then token order):
    "P/L/rows"           float32 [n, hidden_size]  the activations
    "P/L/positions"      int64   [n]  token positions (prompt tokens first)
    "P/L/request_index"  int64   [n]  index into the metadata's "requests"
    "P/L/is_generated"   uint8   [n]  1 for a generated token, 0 for a prompt token
Metadata (string -> string), key "undercurrent.capture", JSON:
    {"format": 2, "model": {ModelInfo fields},
     "points": [{"name", "tensor_type", "layers", "tokens", "pooling", "wire_dtype"}],
     "requests": [{"request_id", "prompt", "prompt_tokens", "generated_tokens",
                   "finish_reason", "text", "example": {"id", "label", "line"}}]}
A point's "layers" are its groups' L (num_layers for final_norm); "tokens" is its
token selector as a probe manifest writes it ({"scope": "generated"}); "pooling"
is "all" (every selected row) or, in a dataset, "last" or "mean" (one row per
request, at its last selected position). "example", present in datasets, is the
labelled example the request ran ("line": of the labelled prompt file, if any).
A point with no rows at a layer has no tensors there.

Rows are stored as float32 whatever the model's dtype ("wire_dtype" says what
travelled; bfloat16 and float16 widen to float32 exactly). A file of another
format, or without this metadata, is refused naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from google.protobuf.json_format import MessageToDict
from safetensors import safe_open
from safetensors.numpy import save

from common.capture_spec import TokenSelector, tensor_type_from_proto
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client.activations import ActivationSet

METADATA_KEY = "undercurrent.capture"
FORMAT = 2
POOLINGS = ("all", "last", "mean")
"""all: every selected row; last: the last selected row; mean: the mean of the
selected rows, at the last selected position."""
PARTS = ("rows", "positions", "request_index", "is_generated")
KEY_BYTES = 8 + 8 + 1
"""Bytes a row's keys take in its group: position, request index and the generated flag."""


class CaptureFileError(ValueError):
    """A file that is not a capture file of this format; names the file and field."""


def model_to_dict(model: types_pb.ModelInfo) -> dict:
    """ModelInfo as the metadata's JSON, every field present (zero values too)."""
    return MessageToDict(model, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def tensor_name(point: str, layer: int, part: str) -> str:
    return f"{point}/{layer}/{part}"


@dataclass(frozen=True)
class LabelledExample:
    """The labelled example a request ran: its id, its label (0 or 1) and, when it
    came from a labelled prompt file, its line there."""

    id: str
    label: int
    line: int | None = None


@dataclass
class CapturedRequest:
    """One prompt's run, as recorded in the metadata."""

    request_id: str
    prompt: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    text: str
    example: LabelledExample | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.example is None:
            del data["example"]
        return data


@dataclass(frozen=True)
class Point:
    """One extraction point as the metadata records it."""

    name: str
    tensor_type: str
    layers: tuple[int, ...]
    tokens: dict  # TokenSelector.to_dict()
    pooling: str  # a POOLINGS value
    wire_dtype: str

    @classmethod
    def of(cls, point: types_pb.ExtractionPoint, model: types_pb.ModelInfo, wire_dtype: str = "",
           pooling: str = "all") -> "Point":
        """The record of a requested point; the wire dtype defaults to the model's (the
        dtype activations travel in)."""
        layers = ((model.num_layers,) if point.tensor_type == types_pb.TENSOR_TYPE_FINAL_NORM
                  else tuple(point.layers))
        return cls(point.name, tensor_type_from_proto(point.tensor_type), layers,
                   TokenSelector.from_proto(point.tokens).to_dict(), pooling,
                   wire_dtype or model.dtype)

    def to_dict(self) -> dict:
        return {**asdict(self), "layers": list(self.layers)}


@dataclass
class Group:
    """The rows of one (point, layer) and their keys, as parallel arrays."""

    point: str
    layer: int
    rows: np.ndarray  # float32 [n, hidden]
    positions: np.ndarray  # int64 [n]
    request_index: np.ndarray  # int64 [n]
    is_generated: np.ndarray  # bool [n]

    def check(self, requests: int, where: str) -> None:
        """Refuses keys that do not line up with the rows or name no request."""
        n = self.rows.shape[0] if self.rows.ndim == 2 else -1
        if n < 0:
            raise CaptureFileError(f"{where}/rows: shape {list(self.rows.shape)} is not [n, hidden]")
        for part in PARTS[1:]:
            array = getattr(self, part)
            if array.shape != (n,):
                raise CaptureFileError(
                    f"{where}/{part}: shape {list(array.shape)}, but rows has {n} rows")
        if n and not (0 <= self.request_index.min() and self.request_index.max() < requests):
            raise CaptureFileError(
                f"{where}/request_index: an index is out of range of the {requests} requests")


def encode(model: types_pb.ModelInfo, points: Sequence[Point], requests: Sequence[CapturedRequest],
           groups: Iterable[Group]) -> bytes:
    """The bytes of a capture file. Rows widen to float32; a wider float is refused,
    not narrowed."""
    names = {p.name for p in points}
    tensors: dict[str, np.ndarray] = {}
    for group in groups:
        where = f"group {group.point}/{group.layer}"
        if group.point not in names:
            raise ValueError(f"{where}: no point is named {group.point!r}")
        if group.rows.dtype.kind != "f" or group.rows.dtype.itemsize > 4:
            raise ValueError(f"{where}: rows are {group.rows.dtype}; a capture file holds float32 "
                             "and would lose their precision")
        group.check(len(requests), where)
        arrays = {
            "rows": group.rows.astype(np.float32, copy=False),
            "positions": group.positions.astype(np.int64, copy=False),
            "request_index": group.request_index.astype(np.int64, copy=False),
            "is_generated": group.is_generated.astype(np.uint8),
        }
        for part, array in arrays.items():
            tensors[tensor_name(group.point, group.layer, part)] = np.ascontiguousarray(array)
    metadata = {
        "format": FORMAT,
        "model": model_to_dict(model),
        "points": [p.to_dict() for p in points],
        "requests": [r.to_dict() for r in requests],
    }
    return save(tensors, metadata={METADATA_KEY: json.dumps(metadata)})


def write(path: str | Path, model: types_pb.ModelInfo, points: Sequence[Point],
          requests: Sequence[CapturedRequest], groups: Iterable[Group]) -> None:
    Path(path).write_bytes(encode(model, points, requests, groups))


def from_activations(activations: ActivationSet, requests: Sequence[CapturedRequest],
                     points: Sequence[types_pb.ExtractionPoint], model: types_pb.ModelInfo
                     ) -> tuple[list[Point], list[Group]]:
    """The points and groups of rows gathered from Generate streams: requests in the
    order given, each one's rows in token order."""
    index = {r.request_id: i for i, r in enumerate(requests)}
    present = set(activations.groups())
    records, groups = [], []
    for point in points:
        record = Point.of(point, model, next(
            (d for (name, _), d in activations.wire_dtypes.items() if name == point.name), ""))
        records.append(record)
        for layer in record.layers:
            parts = [(i, *activations.matrix(rid, point.name, layer))
                     for rid, i in index.items() if (rid, point.name, layer) in present]
            if not parts:
                continue
            groups.append(Group(
                point.name, layer,
                rows=np.concatenate([rows for _, _, rows, _ in parts]),
                positions=np.concatenate([pos for _, pos, _, _ in parts]),
                request_index=np.concatenate([np.full(len(pos), i, np.int64) for i, pos, _, _ in parts]),
                is_generated=np.concatenate([gen for _, _, _, gen in parts]),
            ))
    return records, groups


@dataclass
class CaptureFile:
    """A capture file's metadata; its groups are read one at a time, on demand (a
    dataset shard may hold many)."""

    path: Path
    model: dict
    points: list[Point]
    requests: list[CapturedRequest]
    groups: list[tuple[str, int]]  # (point, layer) of every group with rows

    def group(self, point: str, layer: int) -> Group:
        """One group's arrays; a point's layer without rows gives an empty group."""
        where = f"{self.path}: {point}/{layer}"
        if (point, layer) not in self.groups:
            if any(p.name == point and layer in p.layers for p in self.points):
                hidden = int(self.model.get("hidden_size", 0))
                return Group(point, layer, np.zeros((0, hidden), np.float32), np.zeros(0, np.int64),
                             np.zeros(0, np.int64), np.zeros(0, bool))
            raise CaptureFileError(f"{where}: no such point and layer (the file holds "
                                   f"{[f'{p}/{l}' for p, l in self.groups]})")
        try:
            with safe_open(str(self.path), framework="numpy") as handle:
                arrays = {part: handle.get_tensor(tensor_name(point, layer, part)) for part in PARTS}
        except Exception as err:  # the Rust reader raises its own error types
            raise CaptureFileError(f"{where}: cannot be read: {err}") from None
        arrays["is_generated"] = arrays["is_generated"].astype(bool)
        group = Group(point, layer, **arrays)
        group.check(len(self.requests), where)
        return group

    def find(self, tensor_type: str, layer: int) -> Group:
        """The group of the one point capturing this tensor type at this layer."""
        matches = [p.name for p in self.points if p.tensor_type == tensor_type and layer in p.layers]
        if len(matches) != 1:
            held = [f"{p.tensor_type} {list(p.layers)}" for p in self.points]
            raise CaptureFileError(
                f"{self.path}: points: {len(matches)} points capture {tensor_type} at layer "
                f"{layer}, not one (the file holds {held})")
        return self.group(matches[0], layer)


def read(path: str | Path) -> CaptureFile:
    """The metadata of a capture file, checked; raises CaptureFileError naming the
    file and the field."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            stored = handle.metadata() or {}
            names = list(handle.keys())
    except FileNotFoundError:
        raise CaptureFileError(f"{path}: no such file") from None
    except Exception as err:  # the Rust reader raises its own error types
        raise CaptureFileError(f"{path}: not a safetensors file: {err}") from None
    if METADATA_KEY not in stored:
        raise CaptureFileError(
            f"{path}: metadata {METADATA_KEY!r}: missing, so not a capture file of format "
            f"{FORMAT} (held: {sorted(stored)}); capture it again with this version")
    try:
        metadata = json.loads(stored[METADATA_KEY])
    except json.JSONDecodeError as err:
        raise CaptureFileError(f"{path}: metadata {METADATA_KEY!r}: not valid JSON: {err}") from None
    fields = _Fields(metadata, f"{path}: {METADATA_KEY}")
    found = fields.get("format", object)
    if found != FORMAT:
        raise CaptureFileError(
            f"{path}: {METADATA_KEY}.format: {found!r}, but this version reads format {FORMAT}; "
            "capture it again with this version")
    groups = sorted({(point, int(layer)) for point, layer, part in
                     (name.rsplit("/", 2) for name in names if name.count("/") >= 2)
                     if part == "rows" and layer.isdigit()})
    return CaptureFile(
        path, fields.get("model", dict),
        [_point(p, fields.at("points", i)) for i, p in enumerate(fields.get("points", list))],
        [_request(r, fields.at("requests", i)) for i, r in enumerate(fields.get("requests", list))],
        groups,
    )


class _Fields:
    """Reads a JSON object's fields, naming a missing or mistyped one by its path."""

    def __init__(self, data, where: str):
        if not isinstance(data, dict):
            raise CaptureFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
        self.data, self.where = data, where

    def get(self, key: str, kind: type):
        if key not in self.data:
            raise CaptureFileError(f"{self.where}.{key}: missing")
        value = self.data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CaptureFileError(f"{self.where}.{key}: expected {kind.__name__}, got "
                                   f"{type(value).__name__}")
        return value

    def at(self, key: str, i: int) -> str:
        return f"{self.where}.{key}[{i}]"


def _point(data, where: str) -> Point:
    fields = _Fields(data, where)
    return Point(fields.get("name", str), fields.get("tensor_type", str),
                 tuple(fields.get("layers", list)), fields.get("tokens", dict),
                 fields.get("pooling", str), fields.get("wire_dtype", str))


def _request(data, where: str) -> CapturedRequest:
    fields = _Fields(data, where)
    example = None
    if "example" in data:
        labelled = _Fields(data["example"], f"{where}.example")
        example = LabelledExample(labelled.get("id", str), labelled.get("label", int),
                                  data["example"].get("line"))
    return CapturedRequest(
        fields.get("request_id", str), fields.get("prompt", str), fields.get("prompt_tokens", int),
        fields.get("generated_tokens", int), fields.get("finish_reason", str),
        fields.get("text", str), example=example)
