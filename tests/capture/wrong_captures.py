"""Rows a broken capture would deliver, built from the reference. Each is a bug
capture code could plausibly have (or related projects have shipped); a tolerance
that accepted one of them could not tell it from rounding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tests.capture.oracle import Reference

EVERY_TYPE = frozenset({"residual_stream", "attn_out", "mlp_out", "final_norm"})


@dataclass(frozen=True)
class WrongCapture:
    name: str
    tensor_types: frozenset[str]  # the types it has a wrong row for
    # (reference, tensor_type, layer, position) -> the wrong row, or None where it has none
    row: Callable[[Reference, str, int, int], np.ndarray | None]

    def __str__(self) -> str:
        return self.name


def _neighbouring_layer(ref: Reference, tensor_type: str, layer: int, position: int):
    """The same type one layer later (the last layer: one earlier)."""
    if tensor_type == "final_norm":
        return None
    neighbour = layer + 1 if (tensor_type, layer + 1) in ref.activations else layer - 1
    return ref.activations[(tensor_type, neighbour)][position]


def _residual_before_add(ref: Reference, tensor_type: str, layer: int, position: int):
    """vLLM's decoder layer returns (mlp output, residual) and the stream is their
    sum: the residual alone is the stream without the layer's last add."""
    if tensor_type != "residual_stream":
        return None
    stream = ref.activations[("residual_stream", layer)][position]
    return stream - ref.activations[("mlp_out", layer)][position]


def _final_norm_input(ref: Reference, tensor_type: str, layer: int, position: int):
    """vLLM's fused add-and-norm overwrites its input in place: read before the
    update, the norm's input holds the stream it normalises."""
    if tensor_type != "final_norm":
        return None
    return ref.activations[("residual_stream", layer - 1)][position]


def _final_norm_buffer(ref: Reference, tensor_type: str, layer: int, position: int):
    """... and the buffer the normed output is written into holds the last MLP output."""
    if tensor_type != "final_norm":
        return None
    return ref.activations[("mlp_out", layer - 1)][position]


def _shard_twice(ref: Reference, tensor_type: str, layer: int, position: int):
    """TP rank 0's slice of a row-parallel sum added again after the all-reduce;
    the residual stream carries the MLP output's."""
    source = "mlp_out" if tensor_type == "residual_stream" else tensor_type
    if (source, layer) not in ref.rank0_shards:
        return None
    return ref.activations[(tensor_type, layer)][position] + ref.rank0_shards[(source, layer)][position]


def _shifted(ref: Reference, tensor_type: str, layer: int, position: int):
    """The row of the position before. Position 0 has none, and neither has a
    position whose token repeats the one before: the two rows differ by little
    more than rounding at deep layers (11u, bfloat16 attention output of the
    last layer, measured), so no tolerance near rounding tells them apart; the
    other rows of the same point and layer do."""
    if position == 0 or ref.token_ids[position] == ref.token_ids[position - 1]:
        return None
    return ref.activations[(tensor_type, layer)][position - 1]


WRONG_CAPTURES = [
    WrongCapture("neighbouring-layer", EVERY_TYPE - {"final_norm"}, _neighbouring_layer),
    WrongCapture("residual-before-add", frozenset({"residual_stream"}), _residual_before_add),
    WrongCapture("final-norm-input", frozenset({"final_norm"}), _final_norm_input),
    WrongCapture("final-norm-buffer", frozenset({"final_norm"}), _final_norm_buffer),
    WrongCapture("tp-shard-twice", frozenset({"residual_stream", "attn_out", "mlp_out"}), _shard_twice),
    WrongCapture("shifted-position", EVERY_TYPE, _shifted),
]
