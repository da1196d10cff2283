"""One engine step's merged blocks -> per replica -> per message, and the row
counts each part carries. Pure functions over common.activations.Block."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from common import tensor_codec
from common.activations import Block, ByIdentity


def partition_by_owner(
    blocks: list[Block], owner_of: Callable[[str], str | None]
) -> dict[str | None, list[Block]]:
    """Splits merged blocks by the owner of each row's request (a replica, a client).

    Block order (point, layer) and row order inside each block are kept.
    Rows whose owner is None land under the key None.
    """
    parts: dict[str | None, list[Block]] = {}
    owners_of = ByIdentity(lambda request_ids: _owner_masks(request_ids, owner_of))
    for block in blocks:
        for owner, mask in owners_of(block.request_ids):
            parts.setdefault(owner, []).append(block if mask is None else block.select(mask))
    return parts


def _owner_masks(request_ids: list[str], owner_of: Callable[[str], str | None]) -> list[tuple]:
    """(owner, its rows as a mask, or None when it owns every row) per owner."""
    owners = [owner_of(r) for r in request_ids]
    distinct = list(dict.fromkeys(owners))
    if len(distinct) == 1:
        return [(distinct[0], None)]
    return [(owner, np.fromiter((o == owner for o in owners), dtype=bool, count=len(owners)))
            for owner in distinct]


def holding_little_else(blocks: list[Block]) -> list[Block]:
    """The blocks, where rows that view a buffer the blocks use less than half of
    are replaced by copies of their own: what the blocks keep alive is then at
    most twice their rows' bytes.

    For a queue bounded by its rows' bytes (a replica's send queue) to bound the
    memory it holds: a step's rows arrive from a worker as one buffer, read in
    place (`capture.channel`), which also holds rows for clients and for other
    replicas; a router that stops reading must not keep those alive by the step.
    Where the blocks use most of the buffer (one router, probes on every row) they
    stay views, so the common case copies nothing."""
    users: dict[int, tuple[int, list[int]]] = {}  # id(buffer) -> (its bytes, the blocks viewing it)
    for i, block in enumerate(blocks):
        buffer = buffer_kept_alive(block.rows)
        if buffer is not None:
            users.setdefault(id(buffer), (memoryview(buffer).nbytes, []))[1].append(i)
    copied = list(blocks)
    for size, viewing in users.values():
        if size > 2 * sum(blocks[i].rows.nbytes for i in viewing):
            for i in viewing:
                copied[i] = dataclasses.replace(blocks[i], rows=blocks[i].rows.copy())
    return copied


def buffer_kept_alive(array: np.ndarray) -> object | None:
    """The object whose memory `array` views (through numpy views and memoryviews);
    None when the array owns its memory."""
    buffer: object = array
    while True:
        if isinstance(buffer, np.ndarray) and buffer.base is not None:
            buffer = buffer.base
        elif isinstance(buffer, memoryview):
            buffer = buffer.obj
        else:
            break
    if buffer is array:
        return None
    try:
        memoryview(buffer)
    except TypeError:  # not a buffer numpy knows the size of: left as it is
        return None
    return buffer


# Bytes a batch may need beyond its rows: the SessionRequest envelope, the step,
# and per block its header and key-array tags. Generous on purpose.
_BATCH_OVERHEAD = 64
_BLOCK_OVERHEAD = 96
# Per-row keys: request index (<=5 B varint), position (<=10 B), flag (1 B),
# plus room for a new request id in the table.
_ROW_KEY_BYTES = 16 + 4


def _row_bytes(block: Block, longest_request_id: int) -> int:
    itemsize = tensor_codec.storage_dtype(tensor_codec.wire_dtype_of(block.rows, block.wire_dtype)).itemsize
    return math.prod(block.rows.shape[1:]) * itemsize + _ROW_KEY_BYTES + longest_request_id


def _slice(block: Block, start: int, stop: int) -> Block:
    return Block(
        block.point,
        block.tensor_type,
        block.layer,
        block.rows[start:stop],
        block.request_ids[start:stop],
        block.token_positions[start:stop],
        block.is_generated[start:stop],
        block.wire_dtype,
    )


class RowTooLarge(ValueError):
    """A single row cannot fit in one message; the limit is misconfigured."""


def split_by_size(blocks: list[Block], max_bytes: int) -> list[list[Block]]:
    """Packs blocks into as few parts as fit max_bytes each (an upper-bound estimate).

    Order is kept: concatenating the parts gives back the rows in their order.
    A block is cut row-wise only when it does not fit.
    """
    # Blocks of a step mostly share one request id list (decode_parts): each list once.
    distinct = {id(b.request_ids): b.request_ids for b in blocks}.values()
    longest_id = max((len(r.encode()) for ids in distinct for r in set(ids)), default=0)
    parts: list[list[Block]] = []
    current: list[Block] = []
    size = _BATCH_OVERHEAD
    for block in blocks:
        per_row = _row_bytes(block, longest_id)
        header = _BLOCK_OVERHEAD + len(block.point.encode())
        start = 0
        while start < block.num_rows:
            room = (max_bytes - size - header) // per_row
            if room <= 0:
                if not current:
                    raise RowTooLarge(
                        f"one row of {block.point}@{block.layer} needs ~{per_row + header} bytes, "
                        f"over the {max_bytes}-byte message limit"
                    )
                parts.append(current)
                current, size = [], _BATCH_OVERHEAD
                continue
            stop = min(block.num_rows, start + room)
            current.append(
                block if (start, stop) == (0, block.num_rows) else _slice(block, start, stop)
            )
            size += header + (stop - start) * per_row
            start = stop
    if current:
        parts.append(current)
    return parts


def rows_by_point(blocks: list[Block]) -> dict[str, dict[str, list[int]]]:
    """Per request, per point: the token position of each of its rows in these
    blocks (the lists may be shared between points: read them, never change them)."""
    # Blocks sharing key objects (decode_parts) are split by request once.
    split: dict[tuple[int, int], dict[str, list[int]]] = {}
    result: dict[str, dict[str, list[int]]] = {}
    for block in blocks:
        key = (id(block.request_ids), id(block.token_positions))
        per_request = split.get(key)
        if per_request is None:
            per_request = split[key] = {}
            for request_id, position in zip(block.request_ids, block.token_positions.tolist()):
                positions = per_request.get(request_id)
                if positions is None:
                    per_request[request_id] = [position]
                else:
                    positions.append(position)
        for request_id, positions in per_request.items():
            points = result.get(request_id)
            if points is None:
                result[request_id] = {block.point: positions}
            else:
                earlier = points.get(block.point)
                points[block.point] = positions if earlier is None else earlier + positions
    return result
