"""Workers push each step's captured rows to the engine service, with no round trip.

Draining by `collective_rpc` costs a round trip through vLLM's engine core
after every step, and the engine core serves it between two steps, so each
drain delays the next forward pass. Instead, each shipping worker pushes what
it captured as soon as its forward pass ends, over a ZeroMQ PUSH socket (vLLM
already depends on pyzmq) to one PULL socket the driver binds. Payloads carry
a per-worker sequence number; `unregister` returns each worker's last one, so
the driver knows when every row of an ending request has arrived (a barrier),
and nothing depends on two channels racing.

The socket is a Unix socket in a directory only this user can open. A
shipment is one ZeroMQ message of several frames: its plain values in msgpack
(never pickle, so a stray writer cannot run code in the engine service), then
the buffers its rows live in, each sent as it is (a step's rows are one
buffer, `staging.StepStaging`), and the driver reads the rows in place in the
frames it received: no copy of the rows in Python on either side
(`shipment_frames`, `shipment_from_frames`). Only workers on the driver's
host push; a worker on another node keeps its rows for the `collective_rpc`
drain, which still works for every worker.

"The driver's host" is the hostname, unless the process declares another
identity in UNDERCURRENT_NODE_IDENTITY. Worker nodes (`engine_service.worker_node`)
always declare one of their own: a Unix socket needs a shared filesystem as
well as a shared hostname, and containers with host networking share the name
but not /tmp. Their workers are therefore always drained by RPC, also when
every node runs on one host (which is how that path is tested).

A worker never blocks on a driver that stops reading, and what it holds for
the driver is bounded in bytes (`--capture-backlog-bytes`): the shipments it
handed to ZeroMQ that the driver has not taken yet (in ZeroMQ's queues on
either side, or the kernel's) and those it keeps itself. ZeroMQ bounds its
queues in messages only, and a message is a step's rows (a few KiB to tens of
MB), so the driver tells each worker how far it has read: it writes the last
sequence number it took from a rank into a small file in the sink's private
directory, which the worker maps. A worker hands ZeroMQ no more than the
bound; past it, it keeps shipments, and past the bound in all it drops its
oldest kept ones and reports, in the next shipment it sends, how many rows of
which request it dropped; the driver fails those requests (their rows are
gone; nothing is lost silently). Errors and prefix cache gaps of a dropped
shipment move to the next one.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import shutil
import socket
import tempfile
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

# Payloads a worker queues in ZeroMQ while the driver is not reading; past it the
# worker keeps rows in its own buffer and sends them with a later step. The byte
# bound below applies first unless shipments are tiny.
SEND_HIGH_WATER_MARK = 1024
# Bytes of rows a worker holds for a driver that has not taken them (handed to
# ZeroMQ or kept) before it drops the oldest kept ones.
DEFAULT_BACKLOG_BYTES = 256 * 1024 * 1024


NODE_IDENTITY_ENV = "UNDERCURRENT_NODE_IDENTITY"


def node_identity() -> str:
    """Which node this process runs on, for "can it reach the sink"."""
    return os.environ.get(NODE_IDENTITY_ENV) or socket.gethostname()


@dataclass(frozen=True)
class SinkAddress:
    """Where workers push: a ZeroMQ endpoint, valid on one host only, and the
    bytes each worker may hold while the driver does not read."""

    endpoint: str
    host: str
    directory: str  # private to this user; holds the socket and the read-progress files
    backlog_bytes: int = DEFAULT_BACKLOG_BYTES

    def as_dict(self) -> dict:
        return {"endpoint": self.endpoint, "host": self.host, "directory": self.directory,
                "backlog_bytes": self.backlog_bytes}


class ReadProgress:
    """The last sequence number the driver took from one rank, in an 8-byte file
    both map: the driver writes it as it reads, the worker reads it to know which
    of the shipments it handed to ZeroMQ are still in ZeroMQ's queues."""

    def __init__(self, directory: str, rank: int) -> None:
        descriptor = os.open(Path(directory) / f"read-{rank}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(descriptor).st_size < 8:
                os.ftruncate(descriptor, 8)
            self._map = mmap.mmap(descriptor, 8)
        finally:
            os.close(descriptor)
        self._value = memoryview(self._map).cast("q")

    @property
    def seq(self) -> int:
        return self._value[0]

    @seq.setter
    def seq(self, value: int) -> None:
        self._value[0] = value

    def close(self) -> None:
        self._value.release()
        self._map.close()


class ShipmentError(ValueError):
    """A shipment whose parts point outside the frames that came with it."""


def shipment_frames(shipment: dict) -> tuple[dict, list[memoryview]]:
    """(header, buffers): the shipment with each part's rows replaced by where
    they are, [frame, start, stop], frame 1 being the first buffer; and the
    buffers, which go out as frames after the msgpack of the header.

    Rows that view one contiguous array (the parts of a step all view its
    staging buffer) share that array's frame, sent without a copy; other rows
    (bytes, say) are a frame each. The header's rows are therefore small
    whatever the step, and the buffers are what the worker holds for the driver."""
    header_parts: list[dict] = []
    buffers: list[memoryview] = []
    frame_of: dict[int, int] = {}  # id(root array) -> its frame
    for part in shipment["parts"]:
        rows = memoryview(part["rows"])
        root = _root_array(rows)
        start = _address(np.frombuffer(rows, np.uint8)) - _address(root) if root is not None else -1
        if 0 <= start <= root.nbytes - rows.nbytes:
            if id(root) not in frame_of:
                buffers.append(memoryview(root).cast("B"))
                frame_of[id(root)] = len(buffers)
            where = [frame_of[id(root)], start, start + rows.nbytes]
        else:  # not a stretch of an array (bytes, say): a frame of its own
            buffers.append(memoryview(rows.tobytes()))
            where = [len(buffers), 0, rows.nbytes]
        header_parts.append({**part, "rows": where})
    return {**shipment, "parts": header_parts}, buffers


def _root_array(rows: memoryview) -> np.ndarray | None:
    """The C-contiguous array that non-empty `rows` view (through any numpy views), or None."""
    array = rows.obj
    if not isinstance(array, np.ndarray) or not rows.c_contiguous or not rows.nbytes:
        return None
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array if array.flags.c_contiguous else None


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def shipment_from_frames(frames: list) -> dict:  # zmq.Frame or any bytes-like object
    """The inverse of shipment_frames() at the driver: each part's rows become a
    read-only view of the frame that carried them. Raises ShipmentError naming
    the part whose rows point outside its frames."""
    buffers = [memoryview(frame).toreadonly() for frame in frames]
    shipment = msgspec.msgpack.decode(buffers[0])
    for i, part in enumerate(shipment["parts"]):
        frame, start, stop = part["rows"]
        if not (0 < frame < len(buffers) and 0 <= start <= stop <= len(buffers[frame])):
            raise ShipmentError(
                f"rank {shipment.get('rank')} seq {shipment.get('seq')}: parts[{i}].rows "
                f"[{frame}, {start}, {stop}] is outside the {len(buffers) - 1} buffers that came with it"
            )
        part["rows"] = buffers[frame][start:stop]
    return shipment


@dataclass(eq=False)
class _Waiting:
    """A shipment the socket did not take yet; its header is encoded when first offered."""

    header: dict  # shipment_frames()'s
    buffers: list[memoryview]
    nbytes: int  # the buffers' bytes: what the backlog bound counts
    data: bytes | None = None


def rows_per_request(shipment: dict) -> Counter[str]:
    return Counter(r for part in shipment["parts"] for r in part["request_ids"])


class Pusher:
    """The worker side: one PUSH socket, a sequence number, and what it holds for
    the driver (handed to ZeroMQ and not yet read, or kept) bounded in bytes."""

    def __init__(self, address: dict, rank: int, first_seq: int = 0) -> None:
        self.rank = rank
        self.seq = first_seq  # of the last shipment pushed; the next one is first_seq + 1
        self.backlog_bytes = int(address.get("backlog_bytes", DEFAULT_BACKLOG_BYTES))
        # The process-wide context: a context of its own would block in term()
        # when collected while a socket is open.
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address["endpoint"])
        self._read = ReadProgress(address["directory"], rank)
        self._in_flight: deque[tuple[int, int]] = deque()  # (seq, bytes) handed to ZeroMQ, not yet read
        self._in_flight_bytes = 0
        self._unsent: deque[_Waiting] = deque()
        self._unsent_bytes = 0
        self._keeping_logged = False  # the worker keeps shipments, and said so
        self._dropped: Counter[str] = Counter()  # rows per request, not yet reported
        self.dropped_rows = 0  # every row this worker ever dropped

    @staticmethod
    def reaches(address: dict) -> bool:
        """True when this process runs on the sink's node (the endpoint is host-local)."""
        return address.get("host") == node_identity()

    @property
    def unsent_bytes(self) -> int:
        """Bytes of rows kept by the worker, not yet handed to ZeroMQ."""
        return self._unsent_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of rows the driver has not taken: in ZeroMQ's queues or kept."""
        self._settle()
        return self._in_flight_bytes + self._unsent_bytes

    def push(self, shipment: dict) -> None:
        """Sends one shipment (never blocks: past the bound on what ZeroMQ holds it
        is kept for a later push; past the bound in all the oldest kept shipments
        are dropped)."""
        self.seq += 1
        header, buffers = shipment_frames({**shipment, "seq": self.seq})
        waiting = _Waiting(header, buffers, sum(b.nbytes for b in buffers))
        self._unsent.append(waiting)
        self._unsent_bytes += waiting.nbytes
        self._settle()
        self._bound()
        self.flush()

    def flush(self, for_barrier: bool = False) -> None:
        """Offers the kept shipments to the socket, oldest first, while the socket
        takes them and ZeroMQ holds less than the bound. `for_barrier` offers them
        whatever ZeroMQ holds: the driver's barrier waits for the last one. The
        total held stays bounded: those bytes count until the driver reads them,
        so the pushes that follow keep and drop instead."""
        self._settle()
        while self._unsent:
            head = self._unsent[0]
            if (not for_barrier and self._in_flight
                    and self._in_flight_bytes + head.nbytes > self.backlog_bytes):
                self._keeping(f"it has not read {self._in_flight_bytes} bytes handed to the socket")
                return
            if self._dropped:  # the report rides the next shipment that goes out
                carried = Counter(dict(head.header.get("dropped", ()))) + self._dropped
                head.header["dropped"] = sorted(carried.items())
                self._dropped = Counter()
                head.data = None
            if head.data is None:
                head.data = msgspec.msgpack.encode(head.header)
            try:
                # copy=False: ZeroMQ sends the rows from the step's buffer, which no
                # later step writes (each step gathers into a buffer of its own).
                self._socket.send_multipart([head.data, *head.buffers], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._keeping("the socket's queue is full")
                return
            self._unsent.popleft()
            self._unsent_bytes -= head.nbytes
            self._in_flight.append((head.header["seq"], head.nbytes))
            self._in_flight_bytes += head.nbytes
        self._keeping_logged = False

    def _keeping(self, why: str) -> None:
        """Logs once when the worker starts keeping shipments (not at every step)."""
        if not self._keeping_logged:
            self._keeping_logged = True
            log.warning("capture: the engine service is not reading (%s); rank %d keeps its shipments, "
                        "up to %d bytes in all", why, self.rank, self.backlog_bytes)

    def _settle(self) -> None:
        """Forgets the shipments handed to ZeroMQ that the driver has read."""
        read = self._read.seq
        while self._in_flight and self._in_flight[0][0] <= read:
            self._in_flight_bytes -= self._in_flight.popleft()[1]

    def _bound(self) -> None:
        """Drops the oldest kept shipments while the bytes held are over the bound;
        the newest stays (its sequence number is what the driver's barrier waits for)."""
        while self._in_flight_bytes + self._unsent_bytes > self.backlog_bytes and len(self._unsent) > 1:
            oldest = self._unsent.popleft()
            self._unsent_bytes -= oldest.nbytes
            rows = rows_per_request(oldest.header)
            self.dropped_rows += sum(rows.values())
            self._dropped += rows + Counter(dict(oldest.header.get("dropped", ())))
            successor = self._unsent[0]
            successor.header = {
                **successor.header,
                "gaps": [*oldest.header["gaps"], *successor.header["gaps"]],
                "errors": [*oldest.header["errors"], *successor.header["errors"]],
            }
            successor.data = None
            log.error("capture: rank %d dropped a shipment of %d rows: the engine service has not read "
                      "%d bytes (the backlog bound)", self.rank, sum(rows.values()), self.backlog_bytes)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._read.close()


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
