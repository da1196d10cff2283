"""Which activations a request's probe bindings need captured.

Routers match rows to probes by (tensor_type, layer), so each (tensor_type,
layer) is captured once per request, whatever number of probes read it: a
duplicate row would be scored twice by a trajectory probe. Plain logic.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from common.capture_spec import ExtractionPoint, TokenSelector, tensor_type_from_proto
from common.errors import InvalidArgument
from undercurrent.v1 import types_pb2 as types_pb

PROBE_POINT_PREFIX = "probe."


def probe_points(probes: list[types_pb.ProbeInfo]) -> list[ExtractionPoint]:
    """One point per (tensor_type, layer) the probes read; tokens are the probes'
    common selector, or every token when they differ (routers filter by scope)."""
    selectors: dict[tuple[str, int | None], list[types_pb.TokenSelector]] = defaultdict(list)
    for info in probes:
        tensor_type = tensor_type_from_proto(info.tensor_type)
        layers = list(info.layers) if tensor_type != "final_norm" else [None]
        for layer in layers:
            selectors[(tensor_type, layer)].append(info.tokens)
    points = []
    for (tensor_type, layer), chosen in sorted(selectors.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        # Parsed once per point, not once per probe (a request may bind a thousand
        # probes reading one layer alike); a message unlike the first is parsed to compare.
        tokens = TokenSelector.from_proto(chosen[0])
        if any(s != chosen[0] and TokenSelector.from_proto(s) != tokens for s in chosen):
            tokens = TokenSelector()
        points.append(
            ExtractionPoint(
                name=point_name(tensor_type, layer),
                tensor_type=tensor_type,
                layers=() if layer is None else (layer,),
                tokens=tokens,
            )
        )
    return points


def point_name(tensor_type: str, layer: int | None) -> str:
    """The name of the probe point capturing (tensor_type, layer); layer None: the final norm."""
    return f"{PROBE_POINT_PREFIX}{tensor_type}" + ("" if layer is None else f".{layer}")


def binding_points(info: types_pb.ProbeInfo) -> tuple[str, ...]:
    """The probe points a probe reads (what probe_points captures for it)."""
    tensor_type = tensor_type_from_proto(info.tensor_type)
    if tensor_type == "final_norm":
        return (point_name(tensor_type, None),)
    return tuple(point_name(tensor_type, layer) for layer in info.layers)


class ExpectedRows:
    """How many rows capture makes at each position of one request for some
    probe points, given each point's token selector: one per point whose
    selector picks the position (a probe point is one layer, or the final norm).
    The request's ledger holds each position the model computed to this count,
    so rows that capture lost without a word cannot let a gated token through or
    go uncounted."""

    def __init__(self, selectors: list[TokenSelector], prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self._selectors = Counter(selectors)  # selector -> probe points using it
        # Whole-scope selectors (the usual kind) make a fixed number of rows at every
        # prompt and every generated position: read once from the selectors' own rule
        # (at position 0 and at the first generated position), then counted without
        # numpy, once per token.
        self._per_scope: tuple[int, int] | None = None
        if all(not s.indexes and not s.ranges for s in self._selectors):
            prompt, generated = self._masked(np.array([0, prompt_tokens], dtype=np.int64)).tolist()
            self._per_scope = (prompt, generated)

    def between(self, start: int, stop: int) -> list[int]:
        """Rows expected at each of positions [start, stop)."""
        if self._per_scope is not None:
            prompt, generated = self._per_scope
            return [prompt if p < self.prompt_tokens else generated for p in range(start, stop)]
        return self._masked(np.arange(start, max(start, stop), dtype=np.int64)).tolist()

    def _masked(self, positions: np.ndarray) -> np.ndarray:
        counts = np.zeros(positions.size, dtype=np.int64)
        for selector, points in self._selectors.items():
            counts += points * selector.mask(positions, self.prompt_tokens)
        return counts


def check_client_point_names(points: list[ExtractionPoint]) -> None:
    for i, point in enumerate(points):
        if point.name.startswith(PROBE_POINT_PREFIX):
            raise InvalidArgument(
                f'extraction_points[{i}] "{point.name}": names starting with '
                f'"{PROBE_POINT_PREFIX}" are reserved for probe captures'
            )
