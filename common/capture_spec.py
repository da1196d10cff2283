"""Extraction points: what to capture, where in the model, and for which tokens.

Plain data and validation, shared by the engine (which captures) and anything
that builds requests. Token positions follow one convention everywhere:
prompt tokens are positions [0, prompt_tokens); generated token g (0-based) is
position prompt_tokens + g. The last sampled token of a request is never fed
back through the model, so it has no activations: a request that generates
N tokens yields activations for generated indexes 0..N-2 only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

import numpy as np

from common.errors import InvalidArgument
from undercurrent.v1 import types_pb2 as types_pb

TENSOR_TYPES = ("residual_stream", "attn_out", "mlp_out", "final_norm")

_TENSOR_TYPE_TO_PROTO = {
    "residual_stream": types_pb.TENSOR_TYPE_RESIDUAL_STREAM,
    "attn_out": types_pb.TENSOR_TYPE_ATTN_OUT,
    "mlp_out": types_pb.TENSOR_TYPE_MLP_OUT,
    "final_norm": types_pb.TENSOR_TYPE_FINAL_NORM,
}
_TENSOR_TYPE_FROM_PROTO = {v: k for k, v in _TENSOR_TYPE_TO_PROTO.items()}


def tensor_type_to_proto(name: str) -> int:
    return _TENSOR_TYPE_TO_PROTO[name]


def tensor_type_from_proto(value: int) -> str:
    return _TENSOR_TYPE_FROM_PROTO[value]


class Scope(str, Enum):
    """What a selector's indexes count: prompt tokens, generated tokens, or positions."""

    PROMPT = "prompt"
    GENERATED = "generated"
    ALL = "all"


_SCOPE_FROM_PROTO = {
    types_pb.TokenSelector.SCOPE_UNSPECIFIED: Scope.ALL,
    types_pb.TokenSelector.SCOPE_PROMPT: Scope.PROMPT,
    types_pb.TokenSelector.SCOPE_GENERATED: Scope.GENERATED,
    types_pb.TokenSelector.SCOPE_ALL: Scope.ALL,
}
_SCOPE_TO_PROTO = {
    Scope.PROMPT: types_pb.TokenSelector.SCOPE_PROMPT,
    Scope.GENERATED: types_pb.TokenSelector.SCOPE_GENERATED,
    Scope.ALL: types_pb.TokenSelector.SCOPE_ALL,
}


@dataclass(frozen=True)
class TokenSelector:
    """Token positions of one request, as the proto's TokenSelector defines them.

    `indexes` and `ranges` count within `scope`: PROMPT indexes may be negative
    (-1 is the last prompt token), GENERATED index 0 is the first generated
    token, ALL indexes are absolute positions. A range is [start, stop); stop
    None runs to the end of the scope (for generated tokens: until generation
    ends). No indexes and no ranges selects the whole scope.
    """

    scope: Scope = Scope.ALL
    indexes: tuple[int, ...] = ()
    ranges: tuple[tuple[int, int | None], ...] = ()

    def validate(self, where: str) -> None:
        """Refuses what cannot be resolved while streaming; `where` prefixes messages."""
        for i, index in enumerate(self.indexes):
            if index < 0 and self.scope is not Scope.PROMPT:
                raise InvalidArgument(
                    f"{where}: tokens.indexes[{i}]={index} is negative, which only "
                    f"scope PROMPT allows (the number of generated tokens is unknown "
                    f"while streaming, and absolute positions start at 0)"
                )
        for i, (start, stop) in enumerate(self.ranges):
            if self.scope is not Scope.PROMPT and (start < 0 or (stop is not None and stop < 0)):
                raise InvalidArgument(
                    f"{where}: tokens.ranges[{i}]=[{start}, {_fmt(stop)}) has a negative "
                    f"bound, which only scope PROMPT allows"
                )
            if stop is not None and (start >= 0) == (stop >= 0) and stop <= start:
                raise InvalidArgument(
                    f"{where}: tokens.ranges[{i}]=[{start}, {stop}) is empty (stop <= start)"
                )

    def check_prompt_tokens(self, where: str, prompt_tokens: int) -> None:
        """Refuses PROMPT indexes that fall outside a prompt of this length."""
        if self.scope is not Scope.PROMPT:
            return
        for i, index in enumerate(self.indexes):
            if not -prompt_tokens <= index < prompt_tokens:
                raise InvalidArgument(
                    f"{where}: tokens.indexes[{i}]={index} is outside the prompt of "
                    f"{prompt_tokens} tokens"
                )

    def mask(self, positions: np.ndarray, prompt_tokens: int | np.ndarray) -> np.ndarray:
        """Which of these absolute token positions the selector picks (vectorised).

        The one implementation of the selector rules: the engine calls it with
        one request's prompt length to choose the rows it captures, the router
        with each row's own prompt length (an array shaped like `positions`)
        to choose the rows a probe reads, so the two can never disagree.
        A position is generated when it is >= its request's prompt length.
        """
        positions = np.asarray(positions, dtype=np.int64)
        prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
        if self.scope is Scope.PROMPT:
            in_scope = positions < prompt_tokens
            local = positions
        elif self.scope is Scope.GENERATED:
            in_scope = positions >= prompt_tokens
            local = positions - prompt_tokens
        else:
            in_scope = np.ones(positions.shape, dtype=bool)
            local = positions
        if not self.indexes and not self.ranges:
            # in_scope is a fresh array; broadcast only when prompt_tokens was a scalar.
            return in_scope if in_scope.shape == positions.shape else np.broadcast_to(
                in_scope, positions.shape).copy()
        picked = np.zeros(positions.shape, dtype=bool)
        for index in self.indexes:
            picked |= local == self._resolve(index, prompt_tokens)
        for start, stop in self.ranges:
            inside = local >= self._resolve(start, prompt_tokens)
            if stop is not None:
                inside &= local < self._resolve(stop, prompt_tokens)
            picked |= inside
        return in_scope & picked

    def _resolve(self, index: int, prompt_tokens: int | np.ndarray) -> int | np.ndarray:
        """A PROMPT index counted from the prompt's end (-1: last prompt token) as a position."""
        return prompt_tokens + index if index < 0 and self.scope is Scope.PROMPT else index

    def needs_prompt_positions(self, prompt_tokens: int) -> bool:
        """True when the selector picks some prompt position of a prompt this long."""
        return bool(self.mask(np.arange(prompt_tokens), prompt_tokens).any())

    @classmethod
    def from_proto(cls, msg: types_pb.TokenSelector) -> "TokenSelector":
        return cls(
            scope=_SCOPE_FROM_PROTO[msg.scope],
            indexes=tuple(int(i) for i in msg.indexes),
            ranges=tuple(
                (int(r.start), int(r.stop) if r.HasField("stop") else None) for r in msg.ranges
            ),
        )

    def to_proto(self) -> types_pb.TokenSelector:
        msg = types_pb.TokenSelector(scope=_SCOPE_TO_PROTO[self.scope], indexes=list(self.indexes))
        for start, stop in self.ranges:
            r = msg.ranges.add(start=start)
            if stop is not None:
                r.stop = stop
        return msg

    def to_dict(self) -> dict:
        """As JSON: the `tokens` object of a probe manifest (common.probe_format.manifest
        reads it back), so files that record a selector say it the way probes do."""
        data: dict = {"scope": self.scope.value}
        if self.indexes:
            data["indexes"] = list(self.indexes)
        if self.ranges:
            data["ranges"] = [{"start": start} if stop is None else {"start": start, "stop": stop}
                              for start, stop in self.ranges]
        return data


@dataclass(frozen=True)
class ExtractionPoint:
    """A named place in the forward pass, on one or several layers, for some tokens.

    `layers` is empty for final_norm, whose records carry layer index num_layers.
    """

    name: str
    tensor_type: str
    layers: tuple[int, ...] = ()
    tokens: TokenSelector = field(default_factory=TokenSelector)
    stream_to_client: bool = False

    def capture_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layer indexes records of this point carry."""
        return (num_layers,) if self.tensor_type == "final_norm" else self.layers

    def validate(self, where: str, num_layers: int | None = None) -> None:
        """Checks the point on its own; with num_layers also the layer range."""
        if not self.name:
            raise InvalidArgument(f"{where}: name is empty")
        label = f'{where} "{self.name}"'
        if self.tensor_type not in TENSOR_TYPES:
            raise InvalidArgument(
                f"{label}: tensor_type {self.tensor_type!r} is not one of {list(TENSOR_TYPES)}"
            )
        if self.tensor_type == "final_norm":
            if self.layers:
                raise InvalidArgument(
                    f"{label}: layers must be empty for final_norm (its records carry "
                    f"layer index num_layers), got {list(self.layers)}"
                )
        elif not self.layers:
            raise InvalidArgument(f"{label}: layers is empty; {self.tensor_type} needs at least one")
        seen: set[int] = set()
        for i, layer in enumerate(self.layers):
            if layer in seen:
                raise InvalidArgument(f"{label}: layers[{i}]={layer} is repeated")
            seen.add(layer)
            if num_layers is not None and not 0 <= layer < num_layers:
                raise InvalidArgument(
                    f"{label}: layers[{i}]={layer} is out of range [0, {num_layers})"
                )
        self.tokens.validate(label)

    @classmethod
    def from_proto(cls, msg: types_pb.ExtractionPoint, where: str = "extraction_point") -> "ExtractionPoint":
        """Parses one message; raises InvalidArgument for an unknown tensor type."""
        if msg.tensor_type not in _TENSOR_TYPE_FROM_PROTO:
            known = msg.tensor_type in types_pb.TensorType.values()
            name = types_pb.TensorType.Name(msg.tensor_type) if known else str(msg.tensor_type)
            raise InvalidArgument(
                f'{where} "{msg.name}": tensor_type {name} is not one of '
                f"{[types_pb.TensorType.Name(v) for v in _TENSOR_TYPE_FROM_PROTO]}"
            )
        return cls(
            name=msg.name,
            tensor_type=_TENSOR_TYPE_FROM_PROTO[msg.tensor_type],
            layers=tuple(int(layer) for layer in msg.layers),
            tokens=TokenSelector.from_proto(msg.tokens),
            stream_to_client=msg.stream_to_client,
        )

    def to_proto(self) -> types_pb.ExtractionPoint:
        return types_pb.ExtractionPoint(
            name=self.name,
            tensor_type=_TENSOR_TYPE_TO_PROTO[self.tensor_type],
            layers=list(self.layers),
            tokens=self.tokens.to_proto(),
            stream_to_client=self.stream_to_client,
        )


def parse_points(
    messages: Iterable[types_pb.ExtractionPoint], num_layers: int | None = None
) -> list[ExtractionPoint]:
    """Parses and validates a request's points; errors name `extraction_points[i]`."""
    points = [
        ExtractionPoint.from_proto(msg, f"extraction_points[{i}]") for i, msg in enumerate(messages)
    ]
    validate_points(points, num_layers)
    return points


def validate_points(points: list[ExtractionPoint], num_layers: int | None = None) -> None:
    """Validates each point and the set: point names must be unique (they key records)."""
    names: dict[str, int] = {}
    for i, point in enumerate(points):
        where = f"extraction_points[{i}]"
        point.validate(where, num_layers)
        if point.name in names:
            raise InvalidArgument(
                f'{where} "{point.name}": name is already used by '
                f"extraction_points[{names[point.name]}]"
            )
        names[point.name] = i


def needs_prompt_positions(points: Iterable[ExtractionPoint], prompt_tokens: int) -> bool:
    """True when some point captures prompt tokens: the engine must then compute the
    whole prompt (SamplingParams(skip_reading_prefix_cache=True)), because positions
    served from the prefix cache never pass through the model."""
    return any(point.tokens.needs_prompt_positions(prompt_tokens) for point in points)


def _fmt(stop: int | None) -> str:
    return "end" if stop is None else str(stop)
