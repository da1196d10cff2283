"""Which activations a request's probe bindings need captured.

Routers match rows to probes by (tensor_type, layer), so each (tensor_type,
layer) is captured once per request, whatever number of probes read it: a
duplicate row would be scored twice by a trajectory probe. Plain logic.
"""

from __future__ import annotations

from collections import defaultdict

from common.capture_spec import ExtractionPoint, TokenSelector, tensor_type_from_proto
from common.errors import InvalidArgument
from undercurrent.v1 import undercurrent_pb2 as pb

PROBE_POINT_PREFIX = "probe."


def probe_points(probes: list[pb.ProbeInfo]) -> list[ExtractionPoint]:
    """One point per (tensor_type, layer) the probes read; tokens are the probes'
    common selector, or every token when they differ (routers filter by scope)."""
    selectors: dict[tuple[str, int | None], list[TokenSelector]] = defaultdict(list)
    for info in probes:
        tensor_type = tensor_type_from_proto(info.tensor_type)
        layers = list(info.layers) if tensor_type != "final_norm" else [None]
        for layer in layers:
            selectors[(tensor_type, layer)].append(TokenSelector.from_proto(info.tokens))
    points = []
    for (tensor_type, layer), chosen in sorted(selectors.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        tokens = chosen[0] if all(s == chosen[0] for s in chosen) else TokenSelector()
        suffix = "" if layer is None else f".{layer}"
        points.append(
            ExtractionPoint(
                name=f"{PROBE_POINT_PREFIX}{tensor_type}{suffix}",
                tensor_type=tensor_type,
                layers=() if layer is None else (layer,),
                tokens=tokens,
            )
        )
    return points


def check_client_point_names(points: list[ExtractionPoint]) -> None:
    for i, point in enumerate(points):
        if point.name.startswith(PROBE_POINT_PREFIX):
            raise InvalidArgument(
                f'extraction_points[{i}] "{point.name}": names starting with '
                f'"{PROBE_POINT_PREFIX}" are reserved for probe captures'
            )
