"""The bounded per-replica send queue and what it does when full."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

# Bytes of batches one replica's queue holds by default (`--send-queue-bytes`).
DEFAULT_SEND_QUEUE_BYTES = 256 * 1024 * 1024


class OverflowPolicy(StrEnum):
    """What a full per-replica queue does with one more batch."""

    DROP_OLDEST = "drop_oldest"  # evict the oldest queued batch; freshest data wins
    DROP_NEWEST = "drop_newest"  # refuse the new batch; keeps what is queued in order


@dataclass(eq=False)
class QueuedBatch:
    """One ActivationBatch waiting for its replica, with the ledger entries of its rows."""

    # The ActivationBatch serialised once, when queued, without its step
    # (common.activations.BatchBytes): the session numbers it as it writes,
    # then lets it go (None) while the batch waits for its ack.
    batch_bytes: object
    nbytes: int
    rows: int
    # (request, ledger message) per request with rows in this batch; opaque here.
    entries: list = field(default_factory=list)


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
