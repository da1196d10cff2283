"""Pure logic of the engine's router link: no gRPC, no event loop.

Target parsing, rendezvous hashing, reconnect backoff, splitting one engine
step per replica and per message-size limit, the bounded send queue and its
overflow policies, and the step ledger that turns acks into per-request
processed positions. Everything here is testable on its own.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from common.activations import Block

# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticTargets:
    """A fixed list of replica addresses ("host:port"), one replica each."""

    addresses: tuple[str, ...]


@dataclass(frozen=True)
class DnsTarget:
    """A name re-resolved periodically; every address it resolves to is one replica."""

    host: str
    port: int


def parse_targets(spec: str) -> StaticTargets | DnsTarget:
    """Parses "h1:p1,h2:p2" or "dns:NAME:PORT"; raises ValueError naming the bad part."""
    spec = spec.strip()
    if not spec:
        raise ValueError(
            "router targets: empty; expected host:port[,host:port...] or dns:NAME:PORT"
        )
    if spec.startswith("dns:"):
        host, port = split_host_port(spec[len("dns:") :].lstrip("/"))
        return DnsTarget(host, port)
    addresses = []
    for part in spec.split(","):
        host, port = split_host_port(part.strip())
        addresses.append(join_host_port(host, port))
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"router targets {spec!r}: an address is listed twice")
    return StaticTargets(tuple(addresses))


def split_host_port(text: str) -> tuple[str, int]:
    """ "host:port" or "[v6addr]:port" -> (host, port)."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"router target {text!r}: expected [ipv6]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"router target {text!r}: expected host:port (ipv6 as [addr]:port)")
    if not host:
        raise ValueError(f"router target {text!r}: missing host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"router target {text!r}: port {port_text!r} is not in 1..65535")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------
# Assignment and backoff
# ---------------------------------------------------------------------------


def rendezvous_weight(key: str, replica: str) -> int:
    """A stable pseudo-random weight of (key, replica); the same in every process."""
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_replica(key: str, replicas: Iterable[str]) -> str | None:
    """Highest-random-weight choice: removing a replica moves only the keys it held."""
    return max(replicas, key=lambda r: (rendezvous_weight(key, r), r), default=None)


def backoff_delay(attempt: int, base: float, maximum: float, unit_random: float) -> float:
    """Exponential backoff with jitter in [cap/2, cap], so engines do not reconnect in step."""
    cap = min(maximum, base * (2 ** min(attempt, 32)))
    return cap * (0.5 + 0.5 * unit_random)


# ---------------------------------------------------------------------------
# One engine step -> per replica -> per message
# ---------------------------------------------------------------------------


def partition_by_owner(
    blocks: list[Block], owner_of: Callable[[str], str | None]
) -> dict[str | None, list[Block]]:
    """Splits merged blocks by the replica that owns each row's request.

    Block order (point, layer) and row order inside each block are kept.
    Rows whose owner is None (no replica) land under the key None.
    """
    parts: dict[str | None, list[Block]] = {}
    for block in blocks:
        owners = [owner_of(r) for r in block.request_ids]
        for owner in dict.fromkeys(owners):
            mask = np.fromiter((o == owner for o in owners), dtype=bool, count=len(owners))
            parts.setdefault(owner, []).append(block if mask.all() else block.select(mask))
    return parts


_WIRE_ITEMSIZE = {"bfloat16": 2}
# Bytes a batch may need beyond its rows: the SessionRequest envelope, the step,
# and per block its header and key-array tags. Generous on purpose.
_BATCH_OVERHEAD = 64
_BLOCK_OVERHEAD = 96
# Per-row keys: request index (<=5 B varint), position (<=10 B), flag (1 B),
# plus room for a new request id in the table.
_ROW_KEY_BYTES = 16 + 4


def _row_bytes(block: Block, longest_request_id: int) -> int:
    dtype = block.wire_dtype or block.rows.dtype.name
    itemsize = _WIRE_ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
    hidden = int(np.prod(block.rows.shape[1:], dtype=np.int64))
    return hidden * itemsize + _ROW_KEY_BYTES + longest_request_id


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
    longest_id = max((len(r.encode()) for b in blocks for r in b.request_ids), default=0)
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


def rows_per_request(blocks: list[Block]) -> Counter[str]:
    return Counter(r for b in blocks for r in b.request_ids)


def max_positions(blocks: list[Block]) -> dict[str, int]:
    """The highest token position each request has in these blocks."""
    result: dict[str, int] = {}
    for block in blocks:
        for request_id, position in zip(block.request_ids, block.token_positions.tolist()):
            if position > result.get(request_id, -1):
                result[request_id] = position
    return result


def distinct_positions(blocks: list[Block]) -> dict[str, int]:
    """How many distinct token positions each request has: tokens, not rows."""
    seen: dict[str, set[int]] = {}
    for block in blocks:
        for request_id, position in zip(block.request_ids, block.token_positions.tolist()):
            seen.setdefault(request_id, set()).add(position)
    return {r: len(p) for r, p in seen.items()}


# ---------------------------------------------------------------------------
# Bounded send queue
# ---------------------------------------------------------------------------


class OverflowPolicy(StrEnum):
    """What a full per-replica queue does with one more batch."""

    DROP_OLDEST = "drop_oldest"  # evict the oldest queued batch; freshest data wins
    DROP_NEWEST = "drop_newest"  # refuse the new batch; keeps what is queued in order
    # Report "full" through a predicate so the caller pauses the request; a batch
    # offered anyway is refused as with drop_newest, so memory stays bounded.
    BACKPRESSURE = "backpressure"


@dataclass
class QueuedBatch:
    """One ActivationBatch waiting for its replica, with the bookkeeping it carries."""

    message: object  # pb.SessionRequest with .batch set; step filled in at send time
    nbytes: int
    rows: Counter[str]  # rows per request, counted when dropped
    positions: dict[str, int]  # max token position per request, for acks


@dataclass
class SendQueue:
    """A bounded FIFO of batches and control messages for one replica.

    Only batches count towards the bounds and only batches are ever dropped:
    control messages (request_start/end, heartbeats) keep their order and
    always go out.
    """

    max_batches: int
    max_bytes: int
    policy: OverflowPolicy
    items: deque = field(default_factory=deque)
    batches: int = 0
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.items)

    def is_full(self) -> bool:
        return self.batches >= self.max_batches or self.nbytes >= self.max_bytes

    def put_control(self, message: object) -> None:
        self.items.append(message)

    def put_batch(self, item: QueuedBatch) -> list[QueuedBatch]:
        """Queues item; returns what the overflow policy dropped (maybe item itself)."""
        dropped: list[QueuedBatch] = []
        while self._would_overflow(item):
            if self.policy is not OverflowPolicy.DROP_OLDEST or not self.batches:
                return [*dropped, item]
            dropped.append(self._evict_oldest_batch())
        self.items.append(item)
        self.batches += 1
        self.nbytes += item.nbytes
        return dropped

    def pop(self) -> object:
        item = self.items.popleft()
        if isinstance(item, QueuedBatch):
            self.batches -= 1
            self.nbytes -= item.nbytes
        return item

    def clear(self) -> list[QueuedBatch]:
        """Empties the queue; returns the batches that will never be sent."""
        lost = [i for i in self.items if isinstance(i, QueuedBatch)]
        self.items.clear()
        self.batches = self.nbytes = 0
        return lost

    def _would_overflow(self, item: QueuedBatch) -> bool:
        # An oversized lone batch still goes through an empty queue: the bound
        # limits backlog, while message size is the splitter's job.
        return self.batches > 0 and (
            self.batches + 1 > self.max_batches or self.nbytes + item.nbytes > self.max_bytes
        )

    def _evict_oldest_batch(self) -> QueuedBatch:
        for index, queued in enumerate(self.items):
            if isinstance(queued, QueuedBatch):
                del self.items[index]
                self.batches -= 1
                self.nbytes -= queued.nbytes
                return queued
        raise AssertionError("batches counter says a batch is queued")


# ---------------------------------------------------------------------------
# Acks
# ---------------------------------------------------------------------------


@dataclass
class AckedSteps:
    """What one StepAck settled: processed positions and each step's send time."""

    positions: dict[str, int]
    sent_at: list[float]


@dataclass
class StepLedger:
    """Per session: which request positions each unacknowledged step carried.

    Acks are cumulative: an ack for step N settles every step <= N, so a
    router that coalesces acks is handled too.
    """

    next_step: int = 1
    pending: dict[int, tuple[float, dict[str, int]]] = field(default_factory=dict)

    def record(self, positions: dict[str, int], now: float) -> int:
        step = self.next_step
        self.next_step += 1
        self.pending[step] = (now, positions)
        return step

    def ack(self, step: int) -> AckedSteps:
        settled = sorted(s for s in self.pending if s <= step)
        positions: dict[str, int] = {}
        sent_at = []
        for s in settled:
            sent, step_positions = self.pending.pop(s)
            sent_at.append(sent)
            for request_id, position in step_positions.items():
                positions[request_id] = max(position, positions.get(request_id, -1))
        return AckedSteps(positions, sent_at)
