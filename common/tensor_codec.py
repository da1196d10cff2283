"""Tensors on the wire: raw little-endian bytes, a dtype name and a shape.

As in KServe's Open Inference Protocol and vLLM's serial_utils, a tensor is
never a list of floats. numpy has no bfloat16, so bfloat16 travels as its raw
16-bit patterns and decodes to float32 exactly (a bfloat16 is the top half of
a float32).
"""

from __future__ import annotations

import math

import numpy as np

from undercurrent.v1 import undercurrent_pb2 as pb

# Wire dtype name -> little-endian numpy storage dtype.
_STORAGE = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float64": np.dtype("<f8"),
}
SUPPORTED_DTYPES = tuple(_STORAGE)


class TensorDecodeError(ValueError):
    """A Tensor message whose dtype, shape and bytes do not agree."""


def encode(array: np.ndarray, dtype: str | None = None) -> pb.Tensor:
    """Packs a numpy array. Pass dtype="bfloat16" with a uint16 array of bf16 bits,
    or with a float32 array to round it to bfloat16."""
    name = dtype or array.dtype.name
    if name not in _STORAGE:
        raise TensorDecodeError(f"dtype {name!r} is not one of {SUPPORTED_DTYPES}")
    if name == "bfloat16" and array.dtype != np.uint16:
        array = float32_to_bfloat16_bits(array)
    data = np.ascontiguousarray(array, dtype=_STORAGE[name]).tobytes()
    return pb.Tensor(dtype=name, shape=list(array.shape), data=data)


def decode(tensor: pb.Tensor, as_float32: bool = True) -> np.ndarray:
    """Unpacks a Tensor message; checks that dtype, shape and byte length agree."""
    storage = _STORAGE.get(tensor.dtype)
    if storage is None:
        raise TensorDecodeError(
            f"tensor.dtype {tensor.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}"
        )
    # Python ints: a product such as 2**32 * 2**32 must not wrap to 0 and pass.
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"tensor.shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * storage.itemsize
    if len(tensor.data) != expected:
        raise TensorDecodeError(
            f"tensor.data has {len(tensor.data)} bytes but shape {list(shape)} of "
            f"{tensor.dtype} needs {expected}"
        )
    try:
        array = np.frombuffer(tensor.data, dtype=storage).reshape(shape)
    except (ValueError, OverflowError, MemoryError) as err:  # e.g. a zero-size shape numpy cannot index
        raise TensorDecodeError(f"tensor.shape {list(shape)}: {err}") from None
    if tensor.dtype == "bfloat16":
        return bfloat16_bits_to_float32(array) if as_float32 else array
    return array.astype(np.float32, copy=False) if as_float32 else array


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Rounds to nearest even, as torch does."""
    as_int = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((as_int >> 16) & 1) + 0x7FFF
    return ((as_int + rounding) >> 16).astype(np.uint16)
