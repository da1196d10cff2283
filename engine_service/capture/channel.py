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
which request and point it dropped, at which positions; the driver fails
those requests (their rows are
gone; nothing is lost silently). Errors and prefix cache gaps of a dropped
shipment move to the next one.

The worker side is `capture.worker.pusher.Pusher`, the driver side
`capture.driver.sink.Sink`; this module holds what both agree on: the sink's
address, the read-progress file and a shipment's frames.
"""

from __future__ import annotations

import mmap
import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

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



def dropped_positions(shipment: dict) -> dict[tuple[str, str], list[int]]:
    """The positions of a shipment's rows per (request id, point): what a worker
    reports when it drops the shipment."""
    out: dict[tuple[str, str], list[int]] = defaultdict(list)
    for part in shipment["parts"]:
        positions = np.frombuffer(part["positions"], "<i8").tolist()
        for request_id, position in zip(part["request_ids"], positions):
            out[(request_id, part["point"])].append(position)
    return out


def dropped_report(dropped: dict[tuple[str, str], list[int]]) -> list[tuple[str, str, list[int]]]:
    """Dropped rows as a shipment header carries them: (request id, point, positions)."""
    return sorted((request_id, point, positions) for (request_id, point), positions in dropped.items())


def dropped_in(report) -> dict[tuple[str, str], list[int]]:
    """A shipment header's dropped rows back as positions per (request id, point)."""
    out: dict[tuple[str, str], list[int]] = defaultdict(list)
    for request_id, point, positions in report:
        out[(request_id, point)].extend(positions)
    return out
