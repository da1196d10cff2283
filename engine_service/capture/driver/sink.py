"""The driver side of capture's channel (`capture.channel`): one PULL socket
the workers push to, and how far each worker's sequence has been read.

Runs in the engine service process, next to vLLM's AsyncLLM.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import zmq
import zmq.asyncio

from engine_service.capture.channel import (
    DEFAULT_BACKLOG_BYTES,
    ReadProgress,
    SinkAddress,
    node_identity,
    shipment_from_frames,
)

log = logging.getLogger(__name__)


class Sink:
    """The driver side: one PULL socket, and what each worker's sequence reached."""

    def __init__(self, backlog_bytes: int = DEFAULT_BACKLOG_BYTES) -> None:
        self._directory = Path(tempfile.mkdtemp(prefix="undercurrent-capture-"))  # mode 0700
        self.address = SinkAddress(f"ipc://{self._directory / 'sink'}", node_identity(),
                                   str(self._directory), backlog_bytes)
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address.endpoint)
        self._progress: dict[int, ReadProgress] = {}  # per rank: the last sequence number taken
        weakref.finalize(self, shutil.rmtree, self._directory, True)

    async def receive(self, timeout_s: float, wake: asyncio.Event | None = None) -> list[dict]:
        """Every shipment that has arrived; waits up to timeout_s for the first one,
        or until `wake` is set."""
        shipments = await self._take()
        if shipments or timeout_s <= 0:
            return shipments
        polled = self._socket.poll(timeout_s * 1000, zmq.POLLIN)
        if wake is None:
            await polled
        else:
            woken = asyncio.ensure_future(wake.wait())
            try:
                await asyncio.wait((polled, woken), return_when=asyncio.FIRST_COMPLETED)
            finally:
                polled.cancel()
                woken.cancel()
        return await self._take()

    async def receive_until(self, barrier: dict[int, int], timeout_s: float) -> list[dict]:
        """Shipments until every rank's sequence reached its barrier (or timeout_s passed)."""
        shipments = await self._take()
        deadline = time.monotonic() + timeout_s
        while not self.reached(barrier):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = {r: (self.received(r), s) for r, s in barrier.items() if self.received(r) < s}
                log.error("capture: shipments missing after %.1f s (rank: (received, expected)) %s", timeout_s, missing)
                break
            if await self._socket.poll(left * 1000, zmq.POLLIN):
                shipments += await self._take()
        return shipments

    def reached(self, barrier: dict[int, int]) -> bool:
        return all(self.received(rank) >= seq for rank, seq in barrier.items())

    def received(self, rank: int) -> int:
        """The last sequence number taken from rank (0: none yet)."""
        progress = self._progress.get(rank)
        return 0 if progress is None else progress.seq

    async def _take(self) -> list[dict]:
        """Every shipment already queued, without waiting."""
        shipments = []
        while True:
            try:
                # On an asyncio socket a NOBLOCK receive resolves at once (or raises Again).
                frames = await self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return shipments
            shipment = shipment_from_frames(frames)
            rank = shipment["rank"]
            progress = self._progress.get(rank)
            if progress is None:
                progress = self._progress[rank] = ReadProgress(self.address.directory, rank)
            progress.seq = max(progress.seq, shipment["seq"])
            shipments.append(shipment)

    def close(self) -> None:
        self._socket.close(linger=0)
        for progress in self._progress.values():
            progress.close()
        shutil.rmtree(self._directory, ignore_errors=True)
