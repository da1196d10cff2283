"""Activation records in memory and on the wire.

A record is keyed by (request_id, point, layer, token_position, is_generated).
Records travel packed: one ActivationBlock holds every row of one (point,
layer) in a step, with the keys in parallel arrays. This module is the one
place that converts blocks to and from bytes, both ways they travel: as
ActivationBatch messages (engine to router and client) and as plain-value
parts (capture workers to the engine over vLLM's collective_rpc). Both use
`common.tensor_codec` for the rows. It also defines the forward-pass order
(token_position, layer) a probe sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from common import tensor_codec
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb


@dataclass
class Block:
    """All rows of one (point, layer) in one step, ordered by request (each request's
    rows together, requests in the order the engine computed them), then position."""

    point: str
    tensor_type: int  # types_pb.TensorType value
    layer: int
    rows: np.ndarray  # [n, hidden]
    request_ids: list[str]
    token_positions: np.ndarray  # int64 [n]
    is_generated: np.ndarray  # bool [n]
    # e.g. "bfloat16", whose rows are kept as uint16 bits; default: rows.dtype
    wire_dtype: str | None = None

    def __post_init__(self) -> None:
        n = self.rows.shape[0]
        if not (len(self.request_ids) == len(self.token_positions) == len(self.is_generated) == n):
            raise ValueError(
                f"block {self.point}@{self.layer}: {n} rows but {len(self.request_ids)} request ids, "
                f"{len(self.token_positions)} positions, {len(self.is_generated)} flags"
            )

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    def select(self, mask: np.ndarray) -> "Block":
        idx = np.flatnonzero(mask)
        return Block(
            self.point,
            self.tensor_type,
            self.layer,
            self.rows[idx],
            [self.request_ids[i] for i in idx],
            self.token_positions[idx],
            self.is_generated[idx],
            self.wire_dtype,
        )


@dataclass(frozen=True)
class Record:
    """One row, for consumers that walk records one by one in forward order."""

    request_id: str
    point: str
    tensor_type: int
    layer: int
    token_position: int
    is_generated: bool
    vector: np.ndarray = field(compare=False, repr=False)


# One block as plain values and bytes, so any RPC (pickle, msgpack) carries it cheaply.
WirePart = dict[str, Any]


def encode_part(block: Block, copy: bool = True) -> WirePart:
    """A block as plain values; rows as tensor_codec bytes (bfloat16 stays as bits),
    or with copy=False a read-only view of them (for a sender that sends buffers
    as they are: the rows must not change until sent)."""
    pack = tensor_codec.pack if copy else tensor_codec.pack_view
    dtype, shape, data = pack(block.rows, block.wire_dtype)
    return {
        "point": block.point,
        "tensor_type": int(block.tensor_type),
        "layer": int(block.layer),
        "dtype": dtype,
        "shape": shape,
        "rows": data,
        "request_ids": list(block.request_ids),
        "positions": np.ascontiguousarray(block.token_positions, dtype="<i8").tobytes(),
        "is_generated": np.ascontiguousarray(block.is_generated, dtype=bool).tobytes(),
    }


def decode_part(part: WirePart) -> Block:
    """The inverse of encode_part(); rows keep their wire dtype (bfloat16 as bits)."""
    return decode_parts([part])[0]


def decode_parts(parts: Iterable[WirePart]) -> list[Block]:
    """decode_part() of each part, where a part whose keys (request ids, positions,
    flags) equal the previous part's shares that block's key objects.

    A step's parts, one per (point, layer), mostly carry the same requests at the
    same positions: with every type at every layer, 25 to 100 blocks of one key
    set. Sharing lets the per-step work over keys (ordering, delivery marks,
    routing, message keys) run once per key set (`ByIdentity`) instead of once
    per block. The shared key arrays are read-only."""
    blocks: list[Block] = []
    previous: tuple | None = None
    for part in parts:
        keys = (part["request_ids"], part["positions"], part["is_generated"])
        if keys != previous:
            previous = keys
            positions = np.frombuffer(part["positions"], dtype="<i8").astype(np.int64)
            is_generated = np.frombuffer(part["is_generated"], dtype=bool).copy()
            positions.flags.writeable = is_generated.flags.writeable = False
            shared = (list(part["request_ids"]), positions, is_generated)
        blocks.append(Block(
            point=part["point"],
            tensor_type=part["tensor_type"],
            layer=part["layer"],
            rows=tensor_codec.unpack(part["dtype"], part["shape"], part["rows"], as_float32=False),
            request_ids=shared[0],
            token_positions=shared[1],
            is_generated=shared[2],
            wire_dtype=part["dtype"],
        ))
    return blocks


class ByIdentity:
    """`compute` of some objects, computed once per distinct objects, found by identity.

    For work over a block's keys that blocks sharing key objects (decode_parts)
    need only once. The cache keeps its arguments alive, so their ids cannot be
    reused while it lives; use one per call, never across steps (a key list may
    change in place between them)."""

    def __init__(self, compute: Callable[..., Any]):
        self._compute = compute
        self._results: dict[tuple[int, ...], tuple[tuple, Any]] = {}

    def __call__(self, *objects: Any) -> Any:
        key = tuple(map(id, objects))
        hit = self._results.get(key)
        if hit is None:
            hit = self._results[key] = (objects, self._compute(*objects))
        return hit[1]


def _interned(blocks: list[Block], table: dict[str, int]) -> Iterator[tuple[Block, list[int]]]:
    """Each block with its rows' indexes into the batch's request id table, which
    this fills in first-seen order."""
    previous_ids: list[str] | None = None
    indexes: list[int] = []
    for block in blocks:
        # Blocks of one step mostly list the same requests: reuse their indexes.
        if block.request_ids != previous_ids:
            indexes = [table.setdefault(r, len(table)) for r in block.request_ids]
            previous_ids = block.request_ids
        yield block, indexes


def to_batch(blocks: list[Block], step: int = 0) -> types_pb.ActivationBatch:
    """Packs blocks into one message; request ids are interned in a table."""
    table: dict[str, int] = {}
    batch = types_pb.ActivationBatch(step=step)
    for block, indexes in _interned(blocks, table):
        message = batch.blocks.add(  # add() builds in place; append() would copy the rows
            point=block.point,
            tensor_type=block.tensor_type,
            layer=block.layer,
            request_index=indexes,
            token_positions=block.token_positions.tolist(),
            is_generated=block.is_generated.tolist(),
        )
        dtype, shape, data = tensor_codec.pack(block.rows, block.wire_dtype)
        message.rows.dtype = dtype
        message.rows.shape.extend(shape)
        message.rows.data = data
    batch.request_ids.extend(table)
    return batch


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(message, name: str, wire_type: int) -> bytes:
    return _varint(message.DESCRIPTOR.fields_by_name[name].number << 3 | wire_type)


_VARINT, _LENGTH_DELIMITED = 0, 2
_STEP_TAG = _tag(types_pb.ActivationBatch, "step", _VARINT)
_BLOCKS_TAG = _tag(types_pb.ActivationBatch, "blocks", _LENGTH_DELIMITED)
_ROWS_TAG = _tag(types_pb.ActivationBlock, "rows", _LENGTH_DELIMITED)
_DATA_TAG = _tag(types_pb.Tensor, "data", _LENGTH_DELIMITED)
_SESSION_BATCH_TAG = _tag(session_pb.SessionRequest, "batch", _LENGTH_DELIMITED)


@dataclass(eq=False)
class BatchBytes:
    """An ActivationBatch serialised without its step, as pieces whose concatenation
    is the message: every block's keys and tensor header go through protobuf, its
    rows go in as a view of their array. The one copy of the rows is the join in
    session_request_bytes(); to_batch() and SerializeToString() would copy them
    three times (into the message, out of it, into its wrapper)."""

    pieces: list
    nbytes: int


def batch_bytes(blocks: list[Block]) -> BatchBytes:
    """The bytes of to_batch(blocks) (step 0), rows not copied; protobuf fields may
    come in any order, so each block's rows follow its other fields."""
    table: dict[str, int] = {}
    pieces: list = []
    # Blocks sharing key objects (decode_parts) share their keys' bytes: the
    # point, type and layer go in a message of their own, and two serialised
    # messages of one type joined parse as one with the fields of both.
    row_keys = ByIdentity(lambda indexes, positions, flags: types_pb.ActivationBlock(
        request_index=indexes, token_positions=positions.tolist(), is_generated=flags.tolist(),
    ).SerializeToString())
    tensor_heads: dict[tuple, bytes] = {}
    for block, indexes in _interned(blocks, table):
        keys = types_pb.ActivationBlock(
            point=block.point, tensor_type=block.tensor_type, layer=block.layer,
        ).SerializeToString() + row_keys(indexes, block.token_positions, block.is_generated)
        dtype, shape, data = tensor_codec.pack_view(block.rows, block.wire_dtype)
        tensor_head = tensor_heads.get((dtype, *shape))
        if tensor_head is None:
            tensor_head = tensor_heads[(dtype, *shape)] = types_pb.Tensor(dtype=dtype, shape=shape).SerializeToString()
        if len(data):  # as protobuf does, an empty bytes field is left out
            tensor_head += _DATA_TAG + _varint(len(data))
        tensor_size = len(tensor_head) + len(data)
        rows_head = _ROWS_TAG + _varint(tensor_size)
        block_size = len(keys) + len(rows_head) + tensor_size
        pieces += [_BLOCKS_TAG + _varint(block_size) + keys + rows_head + tensor_head, data]
    pieces.insert(0, types_pb.ActivationBatch(request_ids=list(table)).SerializeToString())
    return BatchBytes(pieces, sum(len(p) for p in pieces))


def session_request_bytes(batch: BatchBytes, step: int) -> bytes:
    """SessionRequest{batch} on the wire with the batch's step set: the step field
    goes in front of the batch's pieces, and one join makes the message."""
    step_field = _STEP_TAG + _varint(step)
    head = _SESSION_BATCH_TAG + _varint(len(step_field) + batch.nbytes) + step_field
    return b"".join([head, *batch.pieces])


class BatchDecodeError(ValueError):
    """An ActivationBatch whose parts do not agree; names the block and field."""


def from_batch(batch: types_pb.ActivationBatch, as_float32: bool = True) -> list[Block]:
    """Unpacks and checks a message; raises BatchDecodeError naming the bad field."""
    reader = BatchReader(batch, as_float32)
    return [reader.block(i)[0] for i in range(len(batch.blocks))]


class BatchReader:
    """Decodes an ActivationBatch block by block, so a receiver can reject one bad
    block and keep the others; the batch's request id table is read once, not
    once per block (a step with every type at every layer has 25 to 100)."""

    def __init__(self, batch: types_pb.ActivationBatch, as_float32: bool = True):
        self.batch = batch
        self.as_float32 = as_float32
        self._ids = np.empty(len(batch.request_ids), dtype=object)
        self._ids[:] = list(batch.request_ids)

    def block(self, i: int) -> tuple[Block, np.ndarray]:
        """blocks[i], and its rows' indexes into the batch's request ids; raises
        BatchDecodeError naming the bad field."""
        msg = self.batch.blocks[i]

        def where() -> str:
            return f"blocks[{i}] ({msg.point}@{msg.layer})"

        try:
            rows = tensor_codec.decode(msg.rows, as_float32=self.as_float32)
        except tensor_codec.TensorDecodeError as err:
            raise BatchDecodeError(f"{where()}.rows: {err}") from err
        if rows.ndim != 2:
            raise BatchDecodeError(f"{where()}.rows: shape {list(rows.shape)} is not [rows, hidden]")
        n = rows.shape[0]
        for name in ("request_index", "token_positions", "is_generated"):
            if len(getattr(msg, name)) != n:
                raise BatchDecodeError(f"{where()}.{name}: {len(getattr(msg, name))} entries for {n} rows")
        # One numpy take instead of a Python look-up per row: a decode step carries
        # hundreds of rows per block. The field is unsigned, so the take's own
        # bounds check is the only one needed.
        index = _array(msg.request_index, np.int64)
        try:
            request_ids = self._ids[index].tolist()
        except IndexError:
            raise BatchDecodeError(
                f"{where()}.request_index: index out of range of {len(self._ids)} request ids"
            ) from None
        block = Block(
            msg.point,
            msg.tensor_type,
            msg.layer,
            rows,
            request_ids,
            _array(msg.token_positions, np.int64),
            _array(msg.is_generated, bool),
            msg.rows.dtype,
        )
        return block, index


def _array(field, dtype) -> np.ndarray:
    """A repeated scalar field as an array: fromiter with the count is 3-4x faster
    than np.asarray, which walks the field as a generic sequence."""
    return np.fromiter(field, dtype, count=len(field))


def forward_order(blocks: list[Block]) -> Iterator[Record]:
    """Every row as a Record, per request in forward-pass order (token_position, layer).

    A point whose layers sit on different pipeline stages arrives as separate
    blocks; this interleaves them the way the forward pass computed them.
    """
    keyed = []
    for b, block in enumerate(blocks):
        for i in range(block.num_rows):
            keyed.append(
                ((block.request_ids[i], int(block.token_positions[i]), block.layer, b, i), block)
            )
    keyed.sort(key=lambda item: item[0])
    for (request_id, position, layer, _, i), block in keyed:
        yield Record(
            request_id,
            block.point,
            block.tensor_type,
            layer,
            position,
            bool(block.is_generated[i]),
            block.rows[i],
        )
