"""Driver-side merge: every worker's drained rows -> ordered blocks, exactly once.

Each worker ships plain bytes per (point, tensor type, layer): a point's name
is its request's own, so two requests may name different tensors alike. The
driver takes the union, drops duplicate keys (TP ranks hold identical values;
only tp_rank 0 of each pipeline stage ships, and this dedup is the guard),
drops keys an earlier drain already delivered (a preempted request recomputes
its positions), and orders everything: blocks by (point, layer), rows by request
(each request's rows together, requests in the order the workers computed them)
then position.
`common.activations.forward_order` then yields (token_position, layer) order
even when one point's layers live on different pipeline stages, which drain
at different times within a step. No vLLM import: tested without vLLM.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from common.activations import Block, ByIdentity
from engine_service.capture.request_ids import parent_request_id


class ShapeMismatch(ValueError):
    """Rows of one (point, tensor type, layer) whose widths disagree across workers."""


def merge_blocks(blocks: list[Block]) -> list[Block]:
    """Union of blocks from any workers and steps, one per (point, tensor type, layer).

    Duplicate (request, position) keys keep their first copy. Blocks come out
    ordered by (point, layer); rows by request, then position, where requests
    keep the order they first appear in (a worker's batch order), not the order
    of their ids: a worker's rows are already in that order and stay as shipped,
    uncopied, whatever the ids. Blocks that shared key objects (decode_parts)
    still share the merged ones, so per-step work over keys runs once per key set.
    """
    groups: dict[tuple[str, int, int], list[Block]] = defaultdict(list)
    for block in blocks:
        groups[(block.point, block.layer, block.tensor_type)].append(block)
    in_order = ByIdentity(lambda ids, positions: _strictly_increasing(_first_seen_codes(ids), positions))
    merged_keys = ByIdentity(lambda *keys: _merged_keys(keys[0::3], keys[1::3], keys[2::3]))
    merged = []
    for (point, layer, tensor_type), parts in sorted(groups.items()):
        widths = {p.rows.shape[1:] for p in parts}
        if len(widths) > 1:
            raise ShapeMismatch(
                f"point {point!r} layer {layer}: workers shipped rows of shapes "
                f"{sorted(list(w) for w in widths)}"
            )
        if len(parts) == 1 and in_order(parts[0].request_ids, parts[0].token_positions):
            # One worker's rows, each request's together in increasing positions with
            # no repeated key (the common case): keep them as they are, no copy.
            merged.append(parts[0])
            continue
        keep, request_ids, positions, is_generated = merged_keys(
            *(key for p in parts for key in (p.request_ids, p.token_positions, p.is_generated)))
        rows = np.concatenate([p.rows for p in parts]) if len(parts) > 1 else parts[0].rows
        merged.append(
            Block(
                point=point,
                tensor_type=tensor_type,
                layer=layer,
                rows=rows[keep],
                request_ids=request_ids,
                token_positions=positions,
                is_generated=is_generated,
                wire_dtype=parts[0].wire_dtype,
            )
        )
    return merged


def _merged_keys(
    request_ids: tuple[list[str], ...], positions: tuple[np.ndarray, ...], is_generated: tuple[np.ndarray, ...]
) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
    """Of the parts' keys, concatenated: which rows to keep, in what order (a stable
    sort by (request in first-seen order, position), the first copy of a key kept),
    and the kept rows' keys."""
    ids = [r for part in request_ids for r in part]
    all_positions = np.concatenate(positions)
    codes = _first_seen_codes(ids)
    order = np.lexsort((np.arange(len(all_positions)), all_positions, codes))
    codes, positions_sorted = codes[order], all_positions[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (codes[1:] != codes[:-1]) | (positions_sorted[1:] != positions_sorted[:-1])
    keep = order[first]
    return keep, [ids[i] for i in keep.tolist()], all_positions[keep], np.concatenate(is_generated)[keep]


def _strictly_increasing(codes: np.ndarray, positions: np.ndarray) -> bool:
    """True when (code, position) pairs are sorted with no repeated pair."""
    if len(codes) < 2:
        return True
    step = np.diff(codes)
    return bool(((step > 0) | ((step == 0) & (np.diff(positions) > 0))).all())


def _first_seen_codes(request_ids: list[str]) -> np.ndarray:
    """Each row's request numbered in the order requests first appear: sorted
    exactly when each request's rows are together."""
    table: dict[str, int] = {}
    return np.fromiter((table.setdefault(r, len(table)) for r in request_ids), dtype=np.int64,
                       count=len(request_ids))


class DeliveredPositions:
    """Exactly-once across drains: remembers, per (request, point, layer), the
    highest position already delivered.

    Within one request the model computes positions in increasing order,
    except after a preemption, which restarts from an earlier position and
    recomputes keys that were already delivered. A high-water mark is enough
    to drop those and costs O(1) per key. Each record id has a slot, and each
    (point, layer) an array of marks by slot, so a block is checked and marked
    with a few array operations whatever its rows.
    """

    _UNSET = -1

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}  # record id -> its index in every marks array
        self._free: list[int] = []
        self._capacity = 0
        self._high: dict[tuple[str, int], np.ndarray] = {}  # (point, layer) -> mark per slot
        self.discarded = 0  # rows of keys already delivered (recomputed)

    def filter(self, blocks: list[Block]) -> list[Block]:
        """Drops rows at or below their key's mark; expects merge_blocks() output
        (rows ordered by request, then position)."""
        runs = ByIdentity(self._runs)
        kept_blocks = []
        for block in blocks:
            n = block.num_rows
            if n == 0:
                continue
            slots, last = runs(block.request_ids)
            marks = self._marks(block.point, block.layer)
            keep = block.token_positions > marks[slots]
            # The last row of each request's run holds its highest position.
            ends = slots[last]
            marks[ends] = np.maximum(marks[ends], block.token_positions[last])
            discarded = n - int(np.count_nonzero(keep))
            self.discarded += discarded
            if not discarded:
                kept_blocks.append(block)
            elif discarded < n:
                kept_blocks.append(block.select(keep))
        return kept_blocks

    def forget(self, request_ids: set[str]) -> None:
        """Frees the marks of finished requests (including their n>1 children)."""
        if not request_ids:
            return
        gone = [r for r in self._slots if parent_request_id(r, request_ids) in request_ids]
        if not gone:
            return
        freed = np.array([self._slots.pop(r) for r in gone], dtype=np.int64)
        for marks in self._high.values():
            marks[freed] = self._UNSET
        self._free += freed.tolist()

    def _runs(self, request_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's slot, and which rows end a run of one request."""
        slots = np.fromiter((self._slot(r) for r in request_ids), dtype=np.int64, count=len(request_ids))
        last = np.ones(len(slots), dtype=bool)
        last[:-1] = slots[1:] != slots[:-1]
        return slots, last

    def _slot(self, record_id: str) -> int:
        slot = self._slots.get(record_id)
        if slot is None:
            if not self._free:
                grown = max(64, 2 * self._capacity)
                self._free = list(range(grown - 1, self._capacity - 1, -1))
                for key, marks in self._high.items():
                    self._high[key] = np.concatenate(
                        [marks, np.full(grown - self._capacity, self._UNSET, dtype=np.int64)])
                self._capacity = grown
            slot = self._slots[record_id] = self._free.pop()
        return slot

    def _marks(self, point: str, layer: int) -> np.ndarray:
        marks = self._high.get((point, layer))
        if marks is None:
            marks = self._high[(point, layer)] = np.full(self._capacity, self._UNSET, dtype=np.int64)
        return marks


class ForwardOrderGate:
    """Holds back rows of points whose layers live on several pipeline stages
    until every layer of a position has arrived.

    With pipeline parallelism several batches are in flight, so one drain can
    bring a position's early layers (first stage) while its late layers (next
    stage) come with a later drain. Releasing a position only when complete
    keeps each (request, point) in (token_position, layer) order across drains.
    Stages compute a request's positions in increasing order, so once a
    position is complete every earlier selected position is too.
    """

    def __init__(self) -> None:
        self._num_layers: dict[tuple[str, str], int] = {}  # (request, point) -> layers
        self._held: list[Block] = []

    def hold(self, request_id: str, point: str, num_layers: int) -> None:
        self._num_layers[(request_id, point)] = num_layers

    def release(self, blocks: list[Block], ending: set[str]) -> list[Block]:
        """Blocks ready for probes; requests in `ending` release what they hold."""
        if not self._num_layers:
            return blocks
        requests = {r for r, _ in self._num_layers}

        def layers_of(record_id: str, point: str) -> int:
            return self._num_layers.get((parent_request_id(record_id, requests), point), 0)

        passing: list[Block] = []
        candidates = list(self._held)
        for block in blocks:
            spans = np.array([layers_of(r, block.point) > 0 for r in block.request_ids])
            if not spans.any():
                passing.append(block)
                continue
            if not spans.all():
                passing.append(block.select(~spans))
            candidates.append(block.select(spans))
        self._held = []
        arrived: dict[tuple[str, str, int], int] = defaultdict(int)
        for block in candidates:
            for record_id, position in zip(block.request_ids, block.token_positions.tolist()):
                arrived[(record_id, block.point, position)] += 1
        for block in candidates:
            ready = np.array(
                [
                    arrived[(r, block.point, p)] >= layers_of(r, block.point)
                    or parent_request_id(r, requests) in ending
                    for r, p in zip(block.request_ids, block.token_positions.tolist())
                ]
            )
            if ready.any():
                passing.append(block.select(ready))
            if not ready.all():
                self._held.append(block.select(~ready))
        self._num_layers = {k: v for k, v in self._num_layers.items() if k[0] not in ending}
        return merge_blocks(passing)
