"""Activation batches as numpy arrays keyed by (request, point, layer, position).

Decoding is common.activations (which uses common.tensor_codec): the same code
the router runs on the same bytes, so a client reads exactly what probes read.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np

from common.activations import from_batch
from undercurrent.v1 import types_pb2 as types_pb


class ActivationKey(NamedTuple):
    """One captured row: which request, which extraction point and layer, which token."""

    request_id: str
    point: str
    layer: int
    token_position: int


def batch_arrays(batch: types_pb.ActivationBatch) -> dict[ActivationKey, np.ndarray]:
    """Every row of one batch as a float32 vector [hidden_size]. Raises
    common.activations.BatchDecodeError (a ValueError) naming a malformed field."""
    out: dict[ActivationKey, np.ndarray] = {}
    for block in from_batch(batch):
        for i, position in enumerate(block.token_positions.tolist()):
            key = ActivationKey(block.request_ids[i], block.point, block.layer, position)
            out[key] = block.rows[i]
    return out


class ActivationSet:
    """Rows gathered from the batches of one or more Generate streams.

    `arrays` maps each ActivationKey to its float32 row; `generated` tells for each
    key whether its token was generated (else a prompt token); `wire_dtypes` the
    dtype each (point, layer) travelled in. A row that arrives twice is an error.
    """

    def __init__(self, batches: Iterable[types_pb.ActivationBatch] = ()):
        self.arrays: dict[ActivationKey, np.ndarray] = {}
        self.generated: dict[ActivationKey, bool] = {}
        self.wire_dtypes: dict[tuple[str, int], str] = {}
        for batch in batches:
            self.add(batch)

    def add(self, batch: types_pb.ActivationBatch) -> int:
        """Adds a batch's rows; returns how many."""
        added = 0
        for block in from_batch(batch):
            self.wire_dtypes[(block.point, block.layer)] = block.wire_dtype
            for i, position in enumerate(block.token_positions.tolist()):
                key = ActivationKey(block.request_ids[i], block.point, block.layer, position)
                if key in self.arrays:
                    raise ValueError(f"activation {key} arrived twice")
                self.arrays[key] = block.rows[i]
                self.generated[key] = bool(block.is_generated[i])
                added += 1
        return added

    def __len__(self) -> int:
        return len(self.arrays)

    def groups(self) -> list[tuple[str, str, int]]:
        """The (request_id, point, layer) triples present, sorted."""
        return sorted({(k.request_id, k.point, k.layer) for k in self.arrays})

    def matrix(self, request_id: str, point: str,
               layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions int64 [n], rows float32 [n, hidden], is_generated bool [n]) of one
        request, point and layer, in token order."""
        keys = sorted(
            (k for k in self.arrays
             if (k.request_id, k.point, k.layer) == (request_id, point, layer)),
            key=lambda k: k.token_position,
        )
        if not keys:
            raise KeyError(f"no rows for request {request_id!r}, point {point!r}, layer {layer}")
        positions = np.array([k.token_position for k in keys], dtype=np.int64)
        rows = np.stack([self.arrays[k] for k in keys]).astype(np.float32, copy=False)
        generated = np.array([self.generated[k] for k in keys], dtype=bool)
        return positions, rows, generated
