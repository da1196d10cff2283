"""The worker side of capture's channel (`capture.channel`): pushes each step's
shipment to the driver's sink, never blocking, holding a bounded backlog.

Runs in each vLLM worker process.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from dataclasses import dataclass

import msgspec
import zmq

from engine_service.capture.channel import (
    DEFAULT_BACKLOG_BYTES,
    ReadProgress,
    dropped_in,
    dropped_positions,
    dropped_report,
    node_identity,
    shipment_frames,
)

log = logging.getLogger(__name__)

# Payloads a worker queues in ZeroMQ while the driver is not reading; past it the
# worker keeps rows in its own buffer and sends them with a later step. The byte
# bound below applies first unless shipments are tiny.
SEND_HIGH_WATER_MARK = 1024


@dataclass(eq=False)
class _Waiting:
    """A shipment the socket did not take yet; its header is encoded when first offered."""

    header: dict  # shipment_frames()'s
    buffers: list[memoryview]
    nbytes: int  # the buffers' bytes: what the backlog bound counts
    data: bytes | None = None



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
        # Positions of rows dropped per (request, point), not yet reported.
        self._dropped: dict[tuple[str, str], list[int]] = defaultdict(list)
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
                carried = dropped_in(head.header.get("dropped", ()))
                for key, positions in self._dropped.items():
                    carried[key].extend(positions)
                head.header["dropped"] = dropped_report(carried)
                self._dropped = defaultdict(list)
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
            rows = dropped_positions(oldest.header)
            for key, positions in [*rows.items(), *dropped_in(oldest.header.get("dropped", ())).items()]:
                self._dropped[key].extend(positions)
            rows = {key: len(positions) for key, positions in rows.items()}
            self.dropped_rows += sum(rows.values())
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


