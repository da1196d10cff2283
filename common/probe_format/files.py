"""Probe files on disk and inline: a JSON manifest plus safetensors weights.

`load_probe_path` accepts the layouts of common/probe_format/layout.py.
Probes are data only: JSON and safetensors, never pickle (nothing here unpickles,
so loading a probe cannot run code; tests/security/test_probe_data.py checks it).
`--probes DIR` loads DIR itself if it holds a manifest.json, else every such
subdirectory and every top-level `.safetensors` file, in name order.

A path from ProbeAdmin.LoadProbe is confined (`ProbeRoot`): it names a probe
under the router's probe root, every file read resolves (symlinks followed)
inside the root, and the files together are at most a size cap. Messages name
paths relative to the root; a path outside it gets one answer whether or not
it exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors

from common import tensor_codec
from common.errors import ResourceExhausted
from common.probe_format.layout import MANIFEST_FILE, METADATA_KEY, WEIGHTS_FILE
from common.probe_format.manifest import ManifestError, manifest_from_dict, parse_manifest
from common.probe_format.probes import Probe, ProbeFiles, build_probe
from undercurrent.v1 import types_pb2 as types_pb

DEFAULT_MAX_INLINE_PROBE_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_PROBE_FILE_BYTES = 256 * 1024 * 1024

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_SAFETENSORS_CODES = {name: code for code, name in _SAFETENSORS_DTYPES.items()}


class ProbeFileError(ValueError):
    """A probe file that cannot be loaded; names the file and the field."""


@dataclass(frozen=True)
class ProbeRoot:
    """Where LoadProbe may read probes from, and how many bytes one may take."""

    directory: Path
    max_bytes: int = DEFAULT_MAX_PROBE_FILE_BYTES

    def locate(self, requested: str) -> Path:
        """The path a LoadProbe names (relative to the root, or absolute under it),
        checked lexically and after resolving symlinks; ProbeFileError otherwise."""
        if not requested or "\0" in requested:
            raise ProbeFileError("path: give a probe directory or .safetensors file under the probe root")
        root = Path(os.path.realpath(self.directory))
        candidate = Path(os.path.normpath(root / requested))
        if not _within(candidate, root) or not _within(Path(os.path.realpath(candidate)), root):
            raise ProbeFileError(f"path: {requested!r} is not under the router's probe root "
                                 "(--probe-root); give it relative to the root")
        return candidate

    def load(self, requested: str) -> Probe:
        path = self.locate(requested)
        return load_probe_path(path, within=self)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def load_probe_path(path: str | Path, within: ProbeRoot | None = None) -> Probe:
    """Loads a probe directory or single-file probe. `within`: every file read
    must resolve under that root, and all of them together fit its cap; messages
    then name paths relative to it."""
    path = Path(path)
    shown = _shown(path, within)
    files = _Reader(within)
    try:
        if path.is_dir():
            manifest_path = path / MANIFEST_FILE
            if not manifest_path.is_file():
                raise ProbeFileError(f"{shown}: no {MANIFEST_FILE} in the probe directory")
            weights_path = path / WEIGHTS_FILE
            manifest = files.read(manifest_path)
            weights = files.read(weights_path) if weights_path.is_file() else None
            return load_probe_bytes(_text(manifest, f"{shown}/{MANIFEST_FILE}"), weights, source=shown)
        if path.is_file() and path.suffix == ".safetensors":
            data = files.read(path)
            manifest_json = _metadata(data).get(METADATA_KEY)
            if manifest_json is None:
                raise ProbeFileError(f"{shown}: no {METADATA_KEY!r} entry in the safetensors metadata")
            return load_probe_bytes(manifest_json, data, source=shown)
        if not path.exists():
            raise ProbeFileError(f"{shown}: no such file or directory")
        raise ProbeFileError(f"{shown}: expected a probe directory or a .safetensors file")
    except (ManifestError, ProbeFileError) as err:
        message = str(err)
        raise ProbeFileError(message if message.startswith(shown) else f"{shown}: {message}") from None
    except OSError as err:
        raise ProbeFileError(f"{shown}: {err.strerror or err}") from None


def _shown(path: Path, within: ProbeRoot | None) -> str:
    """How messages name path: relative to the root it must be under."""
    if within is None:
        return str(path)
    relative = os.path.relpath(path, os.path.realpath(within.directory))
    return "<probe root>" if relative == "." else relative


def _text(data: bytes, shown: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProbeFileError(f"{shown}: not UTF-8 text ({err.reason} at byte {err.start})") from None


class _Reader:
    """Reads a probe's files, each resolving under the root (when confined),
    all of them together within its byte cap."""

    def __init__(self, within: ProbeRoot | None):
        self.within = within
        self.left = within.max_bytes if within is not None else None

    def read(self, path: Path) -> bytes:
        if self.within is None:
            return path.read_bytes()
        root = Path(os.path.realpath(self.within.directory))
        real = Path(os.path.realpath(path))
        if not _within(real, root):
            raise ProbeFileError(f"{_shown(path, self.within)}: resolves outside the probe root")
        with open(real, "rb") as file:
            data = file.read(self.left + 1)
        if len(data) > self.left:
            raise ResourceExhausted(
                f"path: {_shown(path, self.within)} takes the probe over {self.within.max_bytes} bytes "
                "(--max-probe-file-bytes)")
        self.left -= len(data)
        return data


def check_inline_size(manifest_json: str | bytes, weights: bytes, limit: int) -> None:
    """Refuses an inline probe larger than limit bytes before it is parsed."""
    size = len(manifest_json) + len(weights)
    if size > limit:
        raise ResourceExhausted(
            f"inline: {size} bytes of manifest and weights, at most {limit} "
            "(--max-inline-probe-bytes; larger probes load from a path)"
        )


def load_probe_bytes(manifest_json: str | bytes, weights: bytes | None, source: str = "inline") -> Probe:
    """Parses and checks a manifest and its weights (safetensors bytes, or None)."""
    manifest = parse_manifest(manifest_json)
    tensors = read_safetensors(weights, manifest.dtype) if weights else {}
    probe = build_probe(manifest, tensors, source=source, digest=probe_digest(manifest_json, tensors))
    text = manifest_json.decode("utf-8") if isinstance(manifest_json, bytes) else manifest_json
    probe.files = ProbeFiles(text, bytes(weights) if weights else None)
    return probe


def probe_digest(manifest_json: str | bytes, tensors: dict[str, np.ndarray]) -> str:
    """A digest of what a probe is, whatever file layout it came in: its manifest
    as canonical JSON and each tensor's name, dtype, shape and bytes. Routers that
    loaded the same probe agree on it; the engine pins each binding to one."""
    digest = hashlib.sha256()
    canonical = json.dumps(json.loads(manifest_json), sort_keys=True, separators=(",", ":"))
    digest.update(canonical.encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.tobytes())
    return "sha256:" + digest.hexdigest()


def probe_paths(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise ProbeFileError(f"{directory}: not a directory")
    if (directory / MANIFEST_FILE).is_file():
        return [directory]
    return sorted(
        p
        for p in directory.iterdir()
        if (p.is_dir() and (p / MANIFEST_FILE).is_file()) or p.suffix == ".safetensors"
    )


def read_safetensors(data: bytes, expected_dtype: str) -> dict[str, np.ndarray]:
    """Tensors as float32 arrays; each must be stored in the manifest's dtype."""
    try:
        entries = safetensors.deserialize(bytes(data))
    except Exception as err:  # the Rust reader raises its own error types
        raise ManifestError(f"weights: not a valid safetensors file: {err}") from None
    tensors = {}
    for name, entry in entries:
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype != expected_dtype:
            raise ManifestError(
                f"weights: tensor {name!r} is stored as {entry['dtype']}, but manifest.dtype is "
                f"{expected_dtype!r} ({_SAFETENSORS_CODES[expected_dtype]})"
            )
        tensor = types_pb.Tensor(dtype=dtype, shape=entry["shape"], data=bytes(entry["data"]))
        tensors[name] = tensor_codec.decode(tensor)
    return tensors


def encode_safetensors(
    tensors: dict[str, np.ndarray], dtype: str, metadata: dict[str, str] | None = None
) -> bytes:
    """Writes float tensors in `dtype` (bfloat16 rounds to nearest even)."""
    keep_alive, specs = [], {}
    for name, value in tensors.items():
        wire = tensor_codec.encode(np.asarray(value, dtype=np.float32), dtype)
        buffer = np.frombuffer(wire.data, dtype=np.uint8)
        keep_alive.append(buffer)
        specs[name] = safetensors.TensorSpec(
            dtype=dtype, shape=list(wire.shape), data_ptr=buffer.ctypes.data, data_len=buffer.nbytes
        )
    return bytes(safetensors.serialize(specs, metadata=metadata))


def write_probe(
    directory: str | Path,
    manifest: dict[str, Any],
    tensors: dict[str, np.ndarray] | None = None,
    check: bool = True,
) -> Path:
    """Writes a probe directory (manifest.json + weights.safetensors).

    Tensors are float arrays, stored in manifest["dtype"] (default float32). With
    check, the written probe is loaded back so a bad one fails here, not in a router.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    (directory / WEIGHTS_FILE).write_bytes(
        encode_safetensors(tensors or {}, manifest.get("dtype", "float32"))
    )
    if check:
        load_probe_path(directory)
    return directory


def write_probe_file(
    path: str | Path, manifest: dict[str, Any], tensors: dict[str, np.ndarray] | None = None
) -> Path:
    """Writes a single-file probe: weights with the manifest in the safetensors metadata."""
    path = Path(path)
    manifest_from_dict(manifest)
    metadata = {METADATA_KEY: json.dumps(manifest)}
    path.write_bytes(encode_safetensors(tensors or {}, manifest.get("dtype", "float32"), metadata))
    load_probe_path(path)
    return path


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (string to string), checked: a crafted
    header is a ProbeFileError naming what is wrong, never another exception."""
    if len(data) < 8:
        raise ProbeFileError("not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ProbeFileError(f"not a safetensors file (the header claims {length} bytes, the file has "
                             f"{len(data) - 8} after the length)")
    try:
        header = json.loads(data[8 : 8 + length])
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ProbeFileError("not a safetensors file (the header is not JSON)") from None
    if not isinstance(header, dict):
        raise ProbeFileError("not a safetensors file (the header is not a JSON object)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ProbeFileError("safetensors header: __metadata__ must map names to strings")
    return metadata
