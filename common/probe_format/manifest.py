"""Probe manifests: strict parsing, and the compatibility check against a model.

A manifest is the JSON half of a probe file (the weights are safetensors). It is
parsed strictly: an unknown key, a missing key or a wrong type is an error that
names the field, so a typo never silently changes what a probe does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from common.capture_spec import (
    TENSOR_TYPES,
    Scope,
    TokenSelector,
    tensor_type_from_proto,
    tensor_type_to_proto,
)
from common.errors import InvalidArgument
from common.enum_names import from_short_name, short_name
from undercurrent.v1 import types_pb2 as types_pb

TOKEN_KINDS = ("linear", "logistic", "mean_difference", "norm")
"""Kinds that score each row on its own."""
KINDS = (*TOKEN_KINDS, "trajectory", "cascade")
KIND_VALUES = {kind: from_short_name(types_pb.ProbeKind, kind) for kind in KINDS}
"""Each kind as the contract names it (ProbeInfo.kind): ProbeKind has a value per kind."""
AGGREGATIONS = ("ema", "rolling_mean", "max_rolling_mean", "count_over")
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")

ACTIONS = {"observe": types_pb.PROBE_ACTION_OBSERVE, "abort": types_pb.PROBE_ACTION_ABORT}
SCOPES = {scope.value: scope for scope in Scope}


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the field."""


@dataclass(frozen=True)
class AggregationSpec:
    """How a trajectory turns per-token values into a running score."""

    kind: str
    alpha: float = 0.0  # ema
    window: int = 0  # rolling_mean, max_rolling_mean
    over: float = 0.0  # count_over


@dataclass(frozen=True)
class ScorerSpec:
    """What computes a score from rows: a token kind, a trajectory over one, or a cascade.

    Tensors of this scorer are named `<prefix><tensor>` in the weights file.
    """

    kind: str
    prefix: str = ""
    output: str = "raw"  # linear/logistic: "raw" or "sigmoid"
    base: "ScorerSpec | None" = None  # trajectory
    aggregation: AggregationSpec | None = None  # trajectory
    members: tuple["MemberSpec", ...] = ()  # cascade
    k: int = 0  # cascade: members that must agree


@dataclass(frozen=True)
class MemberSpec:
    """One member of a cascade; it agrees on a row when its score >= threshold."""

    name: str
    threshold: float
    scorer: ScorerSpec


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    kind: str
    tensor_type: int  # types_pb.TensorType
    layers: tuple[int, ...]  # empty for final_norm
    hidden_size: int
    dtype: str
    threshold: float
    action: int  # types_pb.ProbeAction
    min_tokens: int
    patience: int
    tokens: TokenSelector  # the rule the engine captures by, in common.capture_spec
    scorer: ScorerSpec
    description: str = ""

    def incompatibility(self, model: types_pb.ModelInfo) -> str | None:
        """Why this probe cannot read the given model's activations, or None."""
        if model.hidden_size != self.hidden_size:
            return (
                f"probe {self.name!r}: hidden_size {self.hidden_size} does not match "
                f"the model's hidden_size {model.hidden_size}"
            )
        out_of_range = [layer for layer in self.layers if layer >= model.num_layers]
        if out_of_range:
            return (
                f"probe {self.name!r}: layers {out_of_range} are out of range for a model "
                f"with num_layers {model.num_layers} (valid: 0..{model.num_layers - 1})"
            )
        offered = set(model.tensor_types)
        if offered and self.tensor_type not in offered:
            names = sorted(
                short_name(types_pb.TensorType, t).lower()
                for t in offered
            )
            return (
                f"probe {self.name!r}: tensor_type {tensor_type_from_proto(self.tensor_type)!r} "
                f"is not offered by the engine (offers {names})"
            )
        return None

    def reads(self, tensor_type: int, layer: int) -> bool:
        if tensor_type != self.tensor_type:
            return False
        return tensor_type == types_pb.TENSOR_TYPE_FINAL_NORM or layer in self.layers


def parse_manifest(text: str | bytes) -> Manifest:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ManifestError(f"manifest is not valid JSON: {err}") from None
    return manifest_from_dict(data)


def manifest_from_dict(data: Any) -> Manifest:
    fields = _Fields(data, "manifest")
    name = fields.string("name")
    if not name or any(c.isspace() for c in name):
        raise ManifestError(f"manifest.name {name!r} must be non-empty without whitespace")
    version = fields.string("version")
    kind = fields.choice("kind", KINDS)
    tensor_type = tensor_type_to_proto(fields.choice("tensor_type", TENSOR_TYPES))
    layers = _layers(fields, tensor_type)
    hidden_size = fields.integer("hidden_size", minimum=1)
    dtype = fields.choice("dtype", WEIGHT_DTYPES, default="float32")
    action = ACTIONS[fields.choice("action", tuple(ACTIONS))]
    rule = _Fields(fields.optional("rule", dict, {}), "manifest.rule")
    min_tokens = rule.integer("min_tokens", minimum=0, default=0)
    patience = rule.integer("patience", minimum=1, default=1)
    rule.done()
    tokens = _token_scope(fields.optional("tokens", dict, {}))
    description = fields.string("description", default="")

    if kind == "cascade":
        if "threshold" in fields.data:
            raise ManifestError(
                "manifest.threshold: a cascade fires on k agreeing members; set manifest.k"
            )
        scorer = _cascade(fields)
        threshold = float(scorer.k)
    else:
        threshold = fields.number("threshold")
        scorer = _scorer(fields, kind, prefix="")
    fields.done()
    return Manifest(
        name=name,
        version=version,
        kind=kind,
        tensor_type=tensor_type,
        layers=layers,
        hidden_size=hidden_size,
        dtype=dtype,
        threshold=threshold,
        action=action,
        min_tokens=min_tokens,
        patience=patience,
        tokens=tokens,
        scorer=scorer,
        description=description,
    )


def _layers(fields: "_Fields", tensor_type: int) -> tuple[int, ...]:
    if "layer" in fields.data and "layers" in fields.data:
        raise ManifestError("manifest: set either layer or layers, not both")
    if tensor_type == types_pb.TENSOR_TYPE_FINAL_NORM:
        if fields.data.get("layers") or "layer" in fields.data:
            raise ManifestError("manifest.layers: final_norm has no layer; leave layers out")
        fields.optional("layers", list, [])
        return ()
    if "layer" in fields.data:
        return (fields.integer("layer", minimum=0),)
    raw = fields.required("layers", list)
    if not raw:
        raise ManifestError("manifest.layers: at least one layer is needed")
    for i, layer in enumerate(raw):
        if not _is_int(layer) or layer < 0:
            raise ManifestError(f"manifest.layers[{i}]: {layer!r} is not a layer index >= 0")
    if len(set(raw)) != len(raw):
        raise ManifestError(f"manifest.layers: {raw} has duplicates")
    return tuple(sorted(raw))


def _token_scope(data: dict) -> TokenSelector:
    fields = _Fields(data, "manifest.tokens")
    scope = SCOPES[fields.choice("scope", tuple(SCOPES), default="generated")]
    indexes = fields.optional("indexes", list, [])
    ranges_raw = fields.optional("ranges", list, [])
    fields.done()
    negative_ok = scope is Scope.PROMPT
    for i, index in enumerate(indexes):
        if not _is_int(index) or (index < 0 and not negative_ok):
            raise ManifestError(
                f"manifest.tokens.indexes[{i}]: {index!r} must be an integer"
                + ("" if negative_ok else " >= 0 (negative indexes count from the prompt's end)")
            )
    ranges = []
    for i, item in enumerate(ranges_raw):
        where = f"manifest.tokens.ranges[{i}]"
        rng = _Fields(item, where)
        start = rng.integer("start", minimum=None if negative_ok else 0)
        stop = rng.integer("stop", minimum=None if negative_ok else 0, default=None)
        rng.done()
        ranges.append((start, stop))
    selector = TokenSelector(scope, tuple(indexes), tuple(ranges))
    try:
        selector.validate("manifest.tokens")
    except InvalidArgument as err:
        raise ManifestError(str(err)) from None
    return selector


def _scorer(fields: "_Fields", kind: str, prefix: str) -> ScorerSpec:
    if kind in ("linear", "logistic"):
        default = "sigmoid" if kind == "logistic" else "raw"
        output = fields.choice("output", ("raw", "sigmoid"), default=default)
        return ScorerSpec(kind, prefix, output=output)
    if kind in ("mean_difference", "norm"):
        return ScorerSpec(kind, prefix)
    if kind == "trajectory":
        base_fields = _Fields(fields.required("base", dict), f"{fields.where}.base")
        base_kind = base_fields.choice("kind", TOKEN_KINDS)
        base = _scorer(base_fields, base_kind, prefix)
        base_fields.done()
        aggregation = _aggregation(
            _Fields(fields.required("aggregation", dict), f"{fields.where}.aggregation")
        )
        return ScorerSpec(kind, prefix, base=base, aggregation=aggregation)
    raise ManifestError(f"{fields.where}.kind: {kind!r} cannot be used here")


def _aggregation(fields: "_Fields") -> AggregationSpec:
    kind = fields.choice("kind", AGGREGATIONS)
    if kind == "ema":
        alpha = fields.number("alpha")
        if not 0 < alpha <= 1:
            raise ManifestError(f"{fields.where}.alpha: {alpha} is not in (0, 1]")
        spec = AggregationSpec(kind, alpha=alpha)
    elif kind in ("rolling_mean", "max_rolling_mean"):
        spec = AggregationSpec(kind, window=fields.integer("window", minimum=1))
    else:
        spec = AggregationSpec(kind, over=fields.number("over"))
    fields.done()
    return spec


def _cascade(fields: "_Fields") -> ScorerSpec:
    raw_members = fields.required("members", list)
    if len(raw_members) < 2:
        raise ManifestError("manifest.members: a cascade needs at least 2 members")
    members = []
    for i, item in enumerate(raw_members):
        member = _Fields(item, f"manifest.members[{i}]")
        name = member.string("name")
        if not name or "." in name:
            raise ManifestError(f"manifest.members[{i}].name {name!r} must be non-empty without '.'")
        kind = member.choice("kind", (*TOKEN_KINDS, "trajectory"))
        threshold = member.number("threshold")
        scorer = _scorer(member, kind, prefix=f"{name}.")
        member.done()
        members.append(MemberSpec(name, threshold, scorer))
    names = [m.name for m in members]
    if len(set(names)) != len(names):
        raise ManifestError(f"manifest.members: names {names} are not unique")
    k = fields.integer("k", minimum=1)
    if k > len(members):
        raise ManifestError(f"manifest.k: {k} is more than the {len(members)} members")
    return ScorerSpec("cascade", members=tuple(members), k=k)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MISSING = object()


class _Fields:
    """Typed access to one JSON object that remembers which keys were read."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected an object, got {type(data).__name__}")
        self.data = data
        self.where = where
        self.seen: set[str] = set()

    def required(self, key: str, kind: type | tuple[type, ...]) -> Any:
        value = self.optional(key, kind, _MISSING)
        if value is _MISSING:
            raise ManifestError(f"{self.where}.{key}: missing")
        return value

    def optional(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        self.seen.add(key)
        if key not in self.data:
            return default
        value = self.data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            expected = "number" if isinstance(kind, tuple) else kind.__name__
            raise ManifestError(
                f"{self.where}.{key}: expected {expected}, got {type(value).__name__} {value!r}"
            )
        return value

    def string(self, key: str, default: Any = _MISSING) -> str:
        if default is _MISSING:
            return self.required(key, str)
        return self.optional(key, str, default)

    def choice(self, key: str, options: tuple[str, ...], default: Any = _MISSING) -> str:
        value = self.string(key, default)
        if value not in options:
            raise ManifestError(f"{self.where}.{key}: {value!r} is not one of {list(options)}")
        return value

    def integer(self, key: str, minimum: int | None = 0, default: Any = _MISSING) -> Any:
        value = self.required(key, int) if default is _MISSING else self.optional(key, int, default)
        if value is not None and minimum is not None and value < minimum:
            raise ManifestError(f"{self.where}.{key}: {value} is less than {minimum}")
        return value

    def number(self, key: str) -> float:
        value = self.required(key, (int, float))
        if isinstance(value, bool) or not math.isfinite(value):
            raise ManifestError(f"{self.where}.{key}: {value!r} is not a finite number")
        return float(value)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise ManifestError(f"{self.where}: unknown field(s) {unknown}")
