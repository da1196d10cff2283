"""Captured activations as one safetensors file, the input of probe training.

Tensors, for each extraction point P and layer L (all requests stacked, in
request then token order):
    "P/L/rows"           float32 [n, hidden_size]  the activations
    "P/L/positions"      int64   [n]  token positions (prompt tokens first)
    "P/L/request_index"  int64   [n]  index into the metadata's "requests"
    "P/L/is_generated"   uint8   [n]  1 for a generated token, 0 for a prompt token
Metadata (string -> string), key "undercurrent.capture", JSON:
    {"format": 1, "model": {ModelInfo fields}, "points": [{"name", "tensor_type",
     "layers", "wire_dtype"}], "requests": [{"request_id", "prompt",
     "prompt_tokens", "generated_tokens", "finish_reason", "text"}]}
Rows are stored as float32 whatever the model's dtype ("wire_dtype" says what
travelled; bfloat16 and float16 widen to float32 exactly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from google.protobuf.json_format import MessageToDict
from safetensors.numpy import load_file, save_file
from safetensors import safe_open

from common.capture_spec import tensor_type_from_proto
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client.activations import ActivationSet

METADATA_KEY = "undercurrent.capture"
FORMAT = 1


@dataclass
class CapturedRequest:
    """One prompt's run, as recorded in the metadata."""

    request_id: str
    prompt: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    text: str


def write(path: str | Path, activations: ActivationSet, requests: list[CapturedRequest],
          points: list[types_pb.ExtractionPoint], model: types_pb.ModelInfo) -> dict[str, tuple[int, ...]]:
    """Writes the file; returns each tensor's name and shape."""
    index = {r.request_id: i for i, r in enumerate(requests)}
    tensors: dict[str, np.ndarray] = {}
    present = set(activations.groups())
    for point in points:
        for layer in _layers(point, model):
            parts = [
                (index[rid], *activations.matrix(rid, point.name, layer))
                for rid in index
                if (rid, point.name, layer) in present
            ]
            if not parts:
                continue
            prefix = f"{point.name}/{layer}"
            tensors[f"{prefix}/rows"] = np.concatenate([rows for _, _, rows, _ in parts])
            tensors[f"{prefix}/positions"] = np.concatenate([pos for _, pos, _, _ in parts])
            tensors[f"{prefix}/request_index"] = np.concatenate(
                [np.full(len(pos), i, dtype=np.int64) for i, pos, _, _ in parts])
            tensors[f"{prefix}/is_generated"] = np.concatenate(
                [gen for _, _, _, gen in parts]).astype(np.uint8)
    metadata = {
        "format": FORMAT,
        "model": MessageToDict(model, preserving_proto_field_name=True),
        "points": [
            {"name": p.name, "tensor_type": tensor_type_from_proto(p.tensor_type),
             "layers": _layers(p, model),
             "wire_dtype": next((d for (name, _), d in activations.wire_dtypes.items()
                                 if name == p.name), model.dtype)}
            for p in points
        ],
        "requests": [vars(r) for r in requests],
    }
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(metadata)})
    return {name: tuple(t.shape) for name, t in tensors.items()}


def read(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, metadata) of a capture file."""
    with safe_open(str(path), framework="numpy") as handle:
        metadata = json.loads((handle.metadata() or {})[METADATA_KEY])
    return load_file(str(path)), metadata


def _layers(point: types_pb.ExtractionPoint, model: types_pb.ModelInfo) -> list[int]:
    if point.tensor_type == types_pb.TENSOR_TYPE_FINAL_NORM:
        return [model.num_layers]
    return list(point.layers)
