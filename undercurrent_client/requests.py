"""Request messages from plain Python values; the clients and the CLI share these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from safetensors import SafetensorError, safe_open

from common.capture_spec import TENSOR_TYPES, tensor_type_to_proto
from common.enum_names import from_short_name
from common.probe_format.layout import MANIFEST_FILE, METADATA_KEY, WEIGHTS_FILE
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb



@dataclass(frozen=True)
class Probe:
    """A probe to bind to a request. failure_policy: "fail_open", "fail_closed" or None
    (the engine's default); action: "observe", "abort" or None (the manifest's)."""

    name: str
    failure_policy: str | None = None
    action: str | None = None

    def to_proto(self) -> types_pb.ProbeBinding:
        binding = types_pb.ProbeBinding(probe=self.name)
        if self.failure_policy:
            binding.failure_policy = from_short_name(types_pb.FailurePolicy, self.failure_policy)
        if self.action:
            binding.action = from_short_name(types_pb.ProbeAction, self.action)
        return binding


def point(spec: str, tokens: types_pb.TokenSelector | None = None, name: str | None = None,
          stream_to_client: bool = True) -> types_pb.ExtractionPoint:
    """An extraction point from "TENSOR_TYPE:LAYER[,LAYER...]" ("residual_stream:12",
    "mlp_out:0,2") or "final_norm"; named after the spec unless `name` is given.
    Raises ValueError naming the bad part."""
    tensor_type, _, layers = spec.partition(":")
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(
            f"{spec!r}: tensor type {tensor_type!r} is not one of {list(TENSOR_TYPES)}")
    try:
        layer_list = [int(layer) for layer in layers.split(",")] if layers else []
    except ValueError:
        raise ValueError(f"{spec!r}: layers must be integers, e.g. residual_stream:12") from None
    if tensor_type == "final_norm":
        if layer_list:
            raise ValueError(f"{spec!r}: final_norm takes no layer")
    elif not layer_list:
        raise ValueError(f"{spec!r}: give a layer, e.g. {tensor_type}:0")
    return types_pb.ExtractionPoint(
        name=name or spec, tensor_type=tensor_type_to_proto(tensor_type), layers=layer_list,
        tokens=tokens, stream_to_client=stream_to_client,
    )


def generate_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    stop: Iterable[str] = (),
    ignore_eos: bool = False,
    probes: Iterable[str | Probe] = (),
    points: Iterable[types_pb.ExtractionPoint] = (),
    gate_tokens: bool | None = None,
    request_id: str = "",
    max_activation_message_bytes: int = 0,
) -> engine_pb.GenerateRequest:
    """A GenerateRequest: a text prompt or token ids, sampling, probes by name (or
    Probe), extraction points (see `point`). Unset sampling fields take the
    engine's defaults, and max_activation_message_bytes 0 the engine's 4 MiB
    split size for streamed activations (the proto documents them); gate_tokens
    None leaves gating to the caller's operator-set bindings."""
    sampling = engine_pb.SamplingParams(max_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                        ("seed", seed), ("repetition_penalty", repetition_penalty)):
        if value is not None:
            setattr(sampling, name, value)
    request = engine_pb.GenerateRequest(
        request_id=request_id, sampling=sampling, extraction_points=list(points),
        max_activation_message_bytes=max_activation_message_bytes,
        probes=[(p if isinstance(p, Probe) else Probe(p)).to_proto() for p in probes],
    )
    if gate_tokens is not None:
        request.gate_tokens = gate_tokens
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def inline_probe(path: str | Path) -> admin_pb.InlineProbe:
    """A local probe to upload: a directory with manifest.json (and
    weights.safetensors), or one .safetensors file whose metadata holds the manifest
    under "undercurrent.manifest". Raises ValueError naming the path."""
    path = Path(path)
    if path.is_dir():
        manifest = path / MANIFEST_FILE
        if not manifest.is_file():
            raise ValueError(f"{path}: no {MANIFEST_FILE} in the probe directory")
        weights = path / WEIGHTS_FILE
        return admin_pb.InlineProbe(
            manifest_json=manifest.read_text(),
            weights_safetensors=weights.read_bytes() if weights.is_file() else b"",
        )
    if path.is_file() and path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="numpy") as handle:
                manifest_json = (handle.metadata() or {}).get(METADATA_KEY)
        except SafetensorError as err:
            raise ValueError(f"{path}: not a safetensors file ({err})") from None
        if manifest_json is None:
            raise ValueError(f"{path}: no {METADATA_KEY!r} entry in the safetensors metadata")
        return admin_pb.InlineProbe(manifest_json=manifest_json, weights_safetensors=path.read_bytes())
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    raise ValueError(f"{path}: expected a probe directory or a .safetensors file")
