"""One replica: its Session stream, send queue and step ledger.

A ReplicaSession keeps one Session open to one router replica, reconnecting
with jittered backoff. It owns the replica's bounded send queue (written by a
writer task, so callers never wait on the network) and the step ledger that
numbers each batch it sends and turns the router's cumulative StepAcks back
into the batches they cover. Everything the link must act on goes up through
a SessionListener: up, down (with the batches that will never be sent), a
batch sent or not, steps acknowledged, and router messages about requests.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

from grpc import aio
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.activations import session_request_bytes
from common.grpc_server import channel_options
from engine_service.link.assignment import backoff_delay
from engine_service.link.config import RouterLinkConfig
from engine_service.link.metrics import LinkMetrics
from engine_service.link.send_queue import QueuedBatch, SendQueue

log = logging.getLogger(__name__)


@dataclass
class AckedSteps:
    """What one StepAck settled: the batches it covered and when each was sent."""

    batches: list[QueuedBatch]
    sent_at: list[float]


@dataclass
class StepLedger:
    """Per session: which batch each unacknowledged step carried.

    Acks are cumulative: an ack for step N settles every step <= N, so a
    router that coalesces acks is handled too. Step numbers start at 1 in
    every session.
    """

    next_step: int = 1
    pending: dict[int, tuple[float, QueuedBatch]] = field(default_factory=dict)

    def record(self, batch: QueuedBatch, now: float) -> int:
        step = self.next_step
        self.next_step += 1
        self.pending[step] = (now, batch)
        return step

    def batch_of(self, step: int) -> QueuedBatch | None:
        """The unacknowledged batch sent as `step`, if any."""
        entry = self.pending.get(step)
        return entry[1] if entry else None

    def ack(self, step: int) -> AckedSteps:
        settled = sorted(s for s in self.pending if s <= step)
        acked = AckedSteps([], [])
        for s in settled:
            sent, batch = self.pending.pop(s)
            acked.sent_at.append(sent)
            acked.batches.append(batch)
        return acked


class SessionListener(Protocol):
    def session_up(self, session: ReplicaSession) -> None: ...

    def session_down(self, session: ReplicaSession, reason: str, unsent: list[QueuedBatch]) -> None: ...

    def batch_sent(self, session: ReplicaSession, batch: QueuedBatch, step: int) -> None: ...

    def batch_unsent(self, session: ReplicaSession, batch: QueuedBatch) -> None: ...

    def steps_acked(self, session: ReplicaSession, batches: list[QueuedBatch]) -> None: ...

    def request_message(self, session: ReplicaSession, message: session_pb.SessionResponse) -> None: ...

    def draining(self, session: ReplicaSession) -> None: ...


class SessionLost(Exception):
    pass


class ReplicaSession:
    """The engine's side of one router replica."""

    def __init__(
        self,
        address: str,
        config: RouterLinkConfig,
        hello: session_pb.SessionRequest,
        listener: SessionListener,
        metrics: LinkMetrics,
    ) -> None:
        self.address = address
        self.config = config
        self.queue = SendQueue(config.queue_max_batches, config.queue_max_bytes, config.overflow_policy)
        self.steps = StepLedger()
        self.up = False
        self.ever_up = False
        self.draining = False
        self.drain_reason = ""
        self.router_id = ""
        self.probes: dict[str, types_pb.ProbeInfo] = {}
        self.requests: set[str] = set()  # ids of the requests homed here
        self.last_received = 0.0
        self.closing = False
        self._hello = hello
        self._listener = listener
        self._metrics = metrics
        self._wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def eligible(self) -> bool:
        """Takes new (and re-homed) requests."""
        return self.up and not self.draining

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"router-session-{self.address}")

    def close(self) -> None:
        """Up: flush the queue and half-close; otherwise stop trying to connect."""
        self.closing = True
        if self.up:
            self._wake.set()
        elif self.task:
            self.task.cancel()

    # -- queueing (never blocks) ----------------------------------------------

    def send_control(self, message: session_pb.SessionRequest) -> None:
        self.queue.put_control(message)
        self._wake.set()

    def send_batch(self, batch: QueuedBatch) -> list[QueuedBatch]:
        """Queues a batch; returns what the overflow policy dropped (maybe it)."""
        dropped = self.queue.put_batch(batch)
        self._wake.set()
        return dropped

    # -- state ------------------------------------------------------------------

    def mark_down(self, reason: str) -> None:
        if self.up:
            self._metrics.replicas_up.dec()
            log.warning("router replica %s down: %s", self.address, reason)
        self.up = False
        self._listener.session_down(self, reason, self.queue.clear())

    def _mark_up(self, hello: session_pb.RouterHello) -> None:
        if self.ever_up:
            self._metrics.reconnects.labels(self.address).inc()
        self.up = self.ever_up = True
        self.draining = False
        self.router_id = hello.router_id
        self.probes = {p.name: p for p in hello.probes}
        self.steps = StepLedger()
        self.last_received = time.monotonic()
        self._metrics.replicas_up.inc()
        log.info(
            "router replica %s up (%s, %d probes)", self.address, hello.router_id, len(self.probes)
        )
        self._listener.session_up(self)

    # -- the stream -------------------------------------------------------------

    async def _run(self) -> None:
        """Keeps one Session open, reconnecting with jittered backoff."""
        attempt = 0
        while not self.closing:
            try:
                await self._session()
                reason = "stream ended"
            except asyncio.CancelledError:
                self.mark_down("cancelled")
                raise
            except (aio.AioRpcError, SessionLost, TimeoutError) as err:
                reason = describe(err)
            except Exception as err:  # never let one replica's bug end its loop
                log.exception("router session %s failed", self.address)
                reason = describe(err)
            was_up = self.up
            self.mark_down(reason)
            if self.closing:
                return
            attempt = 0 if was_up else attempt + 1
            delay = backoff_delay(
                attempt, self.config.reconnect_base_s, self.config.reconnect_max_s, random.random()
            )
            log.info("router session %s down (%s); retrying in %.2fs", self.address, reason, delay)
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        channel = self.config.open_channel(self.address, channel_options(self.config.max_message_bytes))
        # The stub's own call, except that a batch arrives already serialised.
        call = channel.stream_stream(
            _SESSION_METHOD,
            request_serializer=_serialize,
            response_deserializer=session_pb.SessionResponse.FromString,
            _registered_method=True,
        )()
        tasks: list[asyncio.Task] = []
        try:
            async with asyncio.timeout(self.config.heartbeat_timeout_s):
                await call.write(self._hello)
                first = await call.read()
            if first is aio.EOF or not first.HasField("hello"):
                raise SessionLost("router did not answer hello")
            self._mark_up(first.hello)
            reader = asyncio.create_task(self._read_loop(call))
            tasks = [
                reader,
                asyncio.create_task(self._write_loop(call)),
                asyncio.create_task(self._liveness_loop()),
            ]
            # The session lasts until the router ends the stream or a task fails;
            # a writer that half-closed (on close()) leaves the reader to finish.
            pending = set(tasks)
            while reader in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            call.cancel()
            await channel.close(grace=None)

    async def _read_loop(self, call) -> None:
        while True:
            message = await call.read()
            if message is aio.EOF:
                return
            self.last_received = time.monotonic()
            self._on_message(message)

    async def _write_loop(self, call) -> None:
        """Drains the queue into the stream; on close, flushes and half-closes."""
        while True:
            while not self.queue:
                if self.closing:
                    await call.done_writing()
                    return
                self._wake.clear()
                await self._wake.wait()
            item = self.queue.pop()
            if not isinstance(item, QueuedBatch):
                await call.write(item)
                continue
            step = self.steps.record(item, time.monotonic())
            self._listener.batch_sent(self, item, step)
            message = session_request_bytes(item.batch_bytes, step)
            # The message is the one copy of the rows from here on. The step ledger
            # keeps the batch for its ack, not its rows: a router that reads
            # everything and acks nothing must not make the engine hold every row
            # it sent, and a blocked write holds its rows once, not twice.
            item.batch_bytes = None
            try:
                await call.write(message)
            except BaseException:  # failed or cancelled with the session: never sent
                self.steps.pending.pop(step, None)
                self._listener.batch_unsent(self, item)
                raise
            del message  # nor held while the writer waits for the next item
            self._metrics.batches_sent.labels(self.address).inc()
            self._metrics.bytes_sent.labels(self.address).inc(item.nbytes)

    async def _liveness_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        timeout = self.config.heartbeat_timeout_s
        tick = min(interval, timeout / 4)
        next_heartbeat = time.monotonic()
        while True:
            now = time.monotonic()
            if now - self.last_received > timeout:
                raise SessionLost(f"no message for {now - self.last_received:.2f}s")
            if now >= next_heartbeat and not self.closing:
                self.send_control(
                    session_pb.SessionRequest(heartbeat=session_pb.Heartbeat(sent_unix_nanos=time.time_ns()))
                )
                next_heartbeat = now + interval
            await asyncio.sleep(tick)

    def _on_message(self, message: session_pb.SessionResponse) -> None:
        if message.WhichOneof("message") == "replies":
            for reply in message.replies.messages:
                self._on_reply(reply)
        else:
            self._on_reply(message)

    def _on_reply(self, message: session_pb.SessionResponse) -> None:
        """One router reply (a SessionReplies nested in another is ignored: routers never send one)."""
        kind = message.WhichOneof("message")
        if kind == "ack":
            acked = self.steps.ack(message.ack.step)
            now = time.monotonic()
            for sent in acked.sent_at:
                self._metrics.ack_latency.observe(now - sent)
            if acked.batches:
                self._listener.steps_acked(self, acked.batches)
        elif kind in ("scores", "abort", "error"):
            self._listener.request_message(self, message)
        elif kind == "catalog":
            self.probes = {p.name: p for p in message.catalog.probes}
        elif kind == "hello":
            self.probes = {p.name: p for p in message.hello.probes}
        elif kind == "drain":
            self.draining = True
            self.drain_reason = message.drain.reason
            log.info("router replica %s draining (%s)", self.address, self.drain_reason)
            self._listener.draining(self)


_SESSION_METHOD = "/{}/Session".format(session_pb.DESCRIPTOR.services_by_name["ProbeRouterService"].full_name)


def _serialize(message: session_pb.SessionRequest | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def describe(err: BaseException) -> str:
    if isinstance(err, aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
