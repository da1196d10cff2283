"""Tensors on the wire: raw little-endian bytes, a dtype name and a shape.

As in KServe's Open Inference Protocol and vLLM's serial_utils, a tensor is
never a list of floats. numpy has no bfloat16, so bfloat16 travels as its raw
16-bit patterns and decodes to float32 exactly (a bfloat16 is the top half of
a float32).
"""

from __future__ import annotations

import math

import numpy as np

from undercurrent.v1 import types_pb2 as types_pb

# The one table of wire dtypes: name -> little-endian numpy storage dtype.
# Every encoder, decoder and size estimate in both services reads it.
_STORAGE = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float64": np.dtype("<f8"),
}
SUPPORTED_DTYPES = tuple(_STORAGE)


class TensorDecodeError(ValueError):
    """A Tensor message whose dtype, shape and bytes do not agree."""


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype a wire dtype is stored as (bfloat16: uint16 bits)."""
    storage = _STORAGE.get(name)
    if storage is None:
        raise TensorDecodeError(f"dtype {name!r} is not one of {SUPPORTED_DTYPES}")
    return storage


def declared_nbytes(tensor: types_pb.Tensor) -> int:
    """The bytes a Tensor message's shape and dtype declare (an unknown dtype
    counts as float32), without reading `data`: protobuf hands out a new bytes
    object, a copy of all of it, on every read. decode() checks the two agree."""
    storage = _STORAGE.get(tensor.dtype)
    return math.prod(tensor.shape) * (storage.itemsize if storage is not None else 4)


def wire_dtype_of(array: np.ndarray, dtype: str | None = None) -> str:
    """The wire name of an array's rows: `dtype` when given, else the array's own."""
    return dtype or array.dtype.name


def pack(array: np.ndarray, dtype: str | None = None) -> tuple[str, list[int], bytes]:
    """(dtype, shape, little-endian bytes). Pass dtype="bfloat16" with a uint16 array
    of bf16 bits (sent as they are), or with a float32 array to round it to bfloat16."""
    name = wire_dtype_of(array, dtype)
    storage = storage_dtype(name)
    if name == "bfloat16" and array.dtype != np.uint16:
        array = float32_to_bfloat16_bits(array)
    data = np.ascontiguousarray(array, dtype=storage).tobytes()
    return name, [int(d) for d in array.shape], data


def pack_view(array: np.ndarray, dtype: str | None = None) -> tuple[str, list[int], memoryview]:
    """pack() with the bytes as a read-only view of the (little-endian, contiguous)
    array: no copy when the array already is one, as captured rows are."""
    name = wire_dtype_of(array, dtype)
    storage = storage_dtype(name)
    if name == "bfloat16" and array.dtype != np.uint16:
        array = float32_to_bfloat16_bits(array)
    flat = np.ascontiguousarray(array, dtype=storage).reshape(-1)  # a 1-D view: memoryview casts it
    return name, [int(d) for d in array.shape], memoryview(flat.view(np.uint8)).toreadonly()


def unpack(dtype: str, shape, data: bytes, as_float32: bool = True) -> np.ndarray:
    """The inverse of pack(); checks that dtype, shape and byte length agree.

    With as_float32=False, bfloat16 stays as its uint16 bits (no copy)."""
    storage = _STORAGE.get(dtype)
    if storage is None:
        raise TensorDecodeError(
            f"tensor.dtype {dtype!r} is not supported; use one of {SUPPORTED_DTYPES}"
        )
    # Python ints: a product such as 2**32 * 2**32 must not wrap to 0 and pass.
    shape = tuple(map(int, shape))
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"tensor.shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * storage.itemsize
    if len(data) != expected:
        raise TensorDecodeError(
            f"tensor.data has {len(data)} bytes but shape {list(shape)} of "
            f"{dtype} needs {expected}"
        )
    try:
        array = np.frombuffer(data, dtype=storage).reshape(shape)
    except (ValueError, OverflowError, MemoryError) as err:  # e.g. a zero-size shape numpy cannot index
        raise TensorDecodeError(f"tensor.shape {list(shape)}: {err}") from None
    return to_float32(array, dtype) if as_float32 else array


def to_float32(array: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Values unpacked with as_float32=False (bfloat16 as its bits) as float32; into
    `out` (float32, the array's shape) when given, which a caller reuses slice by slice."""
    if out is not None:
        if dtype == "bfloat16":
            np.left_shift(array, 16, dtype=np.uint32, out=out.view(np.uint32))
        else:
            np.copyto(out, array)
        return out
    if dtype == "bfloat16":
        return bfloat16_bits_to_float32(array)
    return array.astype(np.float32, copy=False)


def encode(array: np.ndarray, dtype: str | None = None) -> types_pb.Tensor:
    """Packs a numpy array into a Tensor message (see pack())."""
    name, shape, data = pack(array, dtype)
    return types_pb.Tensor(dtype=name, shape=shape, data=data)


def decode(tensor: types_pb.Tensor, as_float32: bool = True) -> np.ndarray:
    """Unpacks a Tensor message; checks that dtype, shape and byte length agree."""
    return unpack(tensor.dtype, tensor.shape, tensor.data, as_float32)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    # One widening shift into a fresh uint32 array (astype then << made two passes).
    return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Rounds to nearest even, as torch does."""
    as_int = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((as_int >> 16) & 1) + 0x7FFF
    return ((as_int + rounding) >> 16).astype(np.uint16)
