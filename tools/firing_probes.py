"""Probes built from a first run's captured activations, so their firing point
is known in advance: the oracle for end-to-end abort tests and benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.activations import from_batch
from common.probe_format.files import encode_safetensors, write_probe
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import types_pb2 as types_pb

LAYER = 3
TRACE_POINT = "trace"


def trace_point() -> types_pb.ExtractionPoint:
    """The residual stream after LAYER for every generated token, streamed back."""
    return types_pb.ExtractionPoint(
        name=TRACE_POINT, tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM, layers=[LAYER],
        tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_GENERATED), stream_to_client=True,
    )


def rows_by_position(batches: list[types_pb.ActivationBatch]) -> dict[int, np.ndarray]:
    rows = {}
    for batch in batches:
        for block in from_batch(batch):
            for i, position in enumerate(block.token_positions):
                assert int(position) not in rows, f"position {position} arrived twice"
                rows[int(position)] = block.rows[i]
    return rows


@dataclass
class LinearProbe:
    """A linear probe on LAYER's residual stream, loaded inline."""

    name: str
    weight: np.ndarray
    bias: float
    threshold: float

    def manifest(self, action: str = "abort", scope: str = "generated") -> dict:
        return {
            "name": self.name, "version": "1", "kind": "linear", "tensor_type": "residual_stream",
            "layers": [LAYER], "hidden_size": int(self.weight.size), "dtype": "float32",
            "threshold": self.threshold, "action": action, "tokens": {"scope": scope},
        }

    def tensors(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight, "bias": np.array([self.bias], np.float32)}

    def load_request(self, action: str = "abort", scope: str = "generated") -> admin_pb.LoadProbeRequest:
        return admin_pb.LoadProbeRequest(
            inline=admin_pb.InlineProbe(manifest_json=json.dumps(self.manifest(action, scope)),
                                  weights_safetensors=encode_safetensors(self.tensors(), "float32")),
            replace=True,
        )

    def write(self, directory: Path, action: str = "abort") -> Path:
        """The probe as a directory `probe_lifecycle deploy` ships (manifest.json,
        weights.safetensors)."""
        return write_probe(directory, self.manifest(action), self.tensors())

    def score(self, row: np.ndarray) -> float:
        return float(row @ self.weight + self.bias)


@dataclass
class FiringProbe(LinearProbe):
    """A linear probe that fires first at `position` of the target request and
    nowhere in the others."""

    position: int


def probe_firing_at(name: str, target: dict[int, np.ndarray], others: list[dict[int, np.ndarray]],
                    min_index: int) -> FiringProbe:
    """Picks a target position at or after min_index whose row stands apart from
    every earlier target row and every row of the other requests."""
    first = min(target)
    background_all = [row for rows in others for row in rows.values()]
    for position in sorted(target):
        if position - first < min_index:
            continue
        earlier = [target[p] for p in target if p < position]
        background = np.array(earlier + background_all)
        centre = background.mean(axis=0)
        direction = target[position] - centre
        direction /= np.linalg.norm(direction)
        hit = float((target[position] - centre) @ direction)
        highest = float(((background - centre) @ direction).max())
        if hit > highest + 0.2 * abs(hit):
            threshold = (hit + highest) / 2
            return FiringProbe(name, direction.astype(np.float32), float(-centre @ direction),
                               threshold, position)
    raise AssertionError("no target position stands apart; the probe cannot be built")
