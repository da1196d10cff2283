"""One Generate call's outgoing events: a queue bounded in bytes, and activation
batches cut to the size the client can receive.

The producer (vLLM's outputs, the drain loop, router events) never waits on a
slow client: past the byte budget, activation batches and probe scores are
dropped and counted (they are reported in `finished.dropped_records` and the
engine's dropped-records metric). Tokens and `finished` are never dropped: they
are the answer, and a gated token's release is the safety contract's output.

A stream's bytes also count against its caller's budget across all of its
streams (engine_service.request.callers): the share of the Generate call the
stream is created in, unless one is given.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from common import activations
from engine_service.link.batching import RowTooLarge, split_by_size
from engine_service.request.callers import StreamShare, current_share
from undercurrent.v1 import engine_pb2 as engine_pb

# Bytes a GenerateResponse adds around the ActivationBatch it carries (tag and length).
_RESPONSE_OVERHEAD = 16


class ClientStream:
    def __init__(
        self,
        budget_bytes: int,
        max_activation_message_bytes: int,
        on_drop: Callable[[int], None] = lambda records: None,
        share: StreamShare | None = None,
    ):
        self.budget_bytes = budget_bytes
        self.share = share if share is not None else current_share()
        self.max_activation_message_bytes = max_activation_message_bytes
        self.queued_bytes = 0
        self.dropped_records = 0  # activation rows and probe scores the client never got
        self._on_drop = on_drop
        self._queue: deque[tuple[engine_pb.GenerateResponse, int]] = deque()
        self._ready = asyncio.Event()

    def put_nowait(self, response: engine_pb.GenerateResponse) -> bool:
        """Queues one event; returns False when an activation or score event was
        dropped for the budget (and counted)."""
        size = response.ByteSize()
        kind = response.WhichOneof("event")
        if kind in ("activations", "probe_event") and not self._has_room(size):
            self._drop(_records_in(response))
            return False
        self._queue.append((response, size))
        self.queued_bytes += size
        if self.share is not None:
            self.share.queued(size)
        self._ready.set()
        return True

    def put_activations(self, blocks: list[activations.Block]) -> None:
        """Queues a step's client rows as messages no larger than the client's limit."""
        try:
            parts = split_by_size(blocks, self.max_activation_message_bytes - _RESPONSE_OVERHEAD)
        except RowTooLarge:
            self._drop(sum(b.num_rows for b in blocks))
            return
        for part in parts:
            self.put_nowait(engine_pb.GenerateResponse(activations=activations.to_batch(part)))

    async def get(self) -> engine_pb.GenerateResponse:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        response, size = self._queue.popleft()
        self.queued_bytes -= size
        if self.share is not None:
            self.share.read(size)
        return response

    def _has_room(self, size: int) -> bool:
        if self.queued_bytes + size > self.budget_bytes:
            return False
        return self.share is None or self.share.has_room(size)

    def qsize(self) -> int:
        return len(self._queue)

    def _drop(self, records: int) -> None:
        self.dropped_records += records
        self._on_drop(records)


def _records_in(response: engine_pb.GenerateResponse) -> int:
    if response.HasField("activations"):
        return sum(len(block.token_positions) for block in response.activations.blocks)
    return len(response.probe_event.scores.scores)
