"""Which rank owns which layer, and whether a request's points can be served.

Every worker reports its RankTopology once at start-up. Validation against it
happens at request time, so a point aimed at a layer no rank owns, or a tensor
type this TP layout cannot give in full, is a configuration error naming the
point rather than a request that silently never yields records.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.capture_spec import ExtractionPoint, tensor_type_to_proto, validate_points
from common.errors import InvalidArgument
from undercurrent.v1 import types_pb2 as types_pb


@dataclass(frozen=True)
class RankTopology:
    """One worker as it reports itself (plain values, from the worker's RPC)."""

    rank: int
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    start_layer: int
    end_layer: int
    has_final_norm: bool
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    architecture: str
    model: str
    dtype: str
    # Tensor types whose hooks see the full tensor on this rank.
    tensor_types: tuple[str, ...]
    ships: bool  # only tp_rank 0 of each pipeline stage ships rows

    @classmethod
    def from_dict(cls, values: dict) -> "RankTopology":
        values = dict(values)
        values["tensor_types"] = tuple(values["tensor_types"])
        return cls(**values)


@dataclass(frozen=True)
class Topology:
    """Every rank of one engine, in global rank order."""

    ranks: tuple[RankTopology, ...]

    @property
    def first(self) -> RankTopology:
        return self.ranks[0]

    @property
    def num_layers(self) -> int:
        return self.first.num_layers

    def owners(self, layer: int) -> list[RankTopology]:
        return [r for r in self.ranks if r.start_layer <= layer < r.end_layer]

    @property
    def tensor_types(self) -> tuple[str, ...]:
        """Tensor types every rank can give in full, in canonical order."""
        available = set(self.first.tensor_types)
        for rank in self.ranks[1:]:
            available &= set(rank.tensor_types)
        return tuple(t for t in self.first.tensor_types if t in available)

    def validate(self, points: list[ExtractionPoint]) -> None:
        """Raises InvalidArgument naming the point and field that cannot be served."""
        validate_points(points, self.num_layers)
        available = self.tensor_types
        for i, point in enumerate(points):
            label = f'extraction_points[{i}] "{point.name}"'
            if point.tensor_type not in available:
                raise InvalidArgument(
                    f"{label}: tensor_type {point.tensor_type} is not available on this "
                    f"engine ({self.first.architecture}, tensor_parallel_size="
                    f"{self.first.tp_size}): a row-parallel layer is built with "
                    f"reduce_results=False, so no hook sees the full tensor; available: "
                    f"{list(available)}"
                )
            if point.tensor_type == "final_norm":
                if not any(r.has_final_norm for r in self.ranks):
                    raise InvalidArgument(f"{label}: no rank owns the final norm")
                continue
            for j, layer in enumerate(point.layers):
                if not self.owners(layer):
                    spans = [f"rank {r.rank}: [{r.start_layer}, {r.end_layer})" for r in self.ranks]
                    raise InvalidArgument(
                        f"{label}: layers[{j}]={layer} is owned by no rank ({', '.join(spans)})"
                    )

    def model_info(self, vllm_version: str) -> types_pb.ModelInfo:
        first = self.first
        return types_pb.ModelInfo(
            model=first.model,
            architecture=first.architecture,
            num_layers=first.num_layers,
            hidden_size=first.hidden_size,
            dtype=first.dtype,
            tensor_parallel_size=first.tp_size,
            pipeline_parallel_size=first.pp_size,
            ranks=[
                types_pb.RankInfo(
                    rank=r.rank,
                    tp_rank=r.tp_rank,
                    pp_rank=r.pp_rank,
                    start_layer=r.start_layer,
                    end_layer=r.end_layer,
                    has_final_norm=r.has_final_norm,
                )
                for r in self.ranks
            ],
            tensor_types=[tensor_type_to_proto(t) for t in self.tensor_types],
            vocab_size=first.vocab_size,
            max_model_len=first.max_model_len,
            vllm_version=vllm_version,
        )
