"""The engine's connection to its probe routers: one Session stream per replica.

The engine's drain loop calls start_request / send_step / end_request; none of
them awaits the network. They place messages on a bounded per-replica queue
that a writer task drains, so a slow or dead router can never stall vLLM's
scheduler. Each request lives on one replica, chosen by rendezvous hashing of
its id over the replicas that are up; when that replica goes down or drains,
the request is re-homed (request_start with state_reset=True) and the owner is
told. What the routers send back reaches the owner as LinkEvent values through
one callback, in the order each router sent them (so a verdict caused by step N
arrives before "processed" for step N).

All methods must be called from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Union

from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc

from common.activations import Block, to_batch
from common.grpc_server import MAX_MESSAGE_BYTES, channel_options
from engine_service import routing
from engine_service.routing import OverflowPolicy, QueuedBatch, SendQueue, StepLedger

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Configuration and events
# ---------------------------------------------------------------------------


@dataclass
class RouterLinkConfig:
    # "host:port[,host:port...]" or "dns:NAME:PORT" (every resolved address is a replica).
    targets: str
    engine_id: str = "engine"
    heartbeat_interval_s: float = 2.0
    # A replica that sent nothing (not even a heartbeat) for this long is down.
    heartbeat_timeout_s: float = 6.0
    reconnect_base_s: float = 0.1
    reconnect_max_s: float = 5.0
    dns_refresh_s: float = 5.0
    # A request without a reachable replica this long gets an Unavailable event.
    router_timeout_s: float = 5.0
    queue_max_batches: int = 64
    queue_max_bytes: int = 256 * 1024 * 1024
    overflow_policy: OverflowPolicy = OverflowPolicy.DROP_OLDEST
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # close(): how long to wait for queues to flush and routers to end their streams.
    close_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        self.overflow_policy = OverflowPolicy(self.overflow_policy)
        routing.parse_targets(self.targets)  # fail at configuration time
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")


@dataclass(frozen=True)
class Scores:
    request_id: str
    scores: pb.ProbeScores
    replica: str


@dataclass(frozen=True)
class Abort:
    request_id: str
    verdict: pb.Verdict
    replica: str


@dataclass(frozen=True)
class Processed:
    """The request's rows up to token_position (inclusive) went through its probes."""

    request_id: str
    token_position: int
    replica: str


@dataclass(frozen=True)
class RequestFailed:
    """An in-band RequestError from a router; the stream and other requests go on."""

    request_id: str
    error: pb.RequestError
    replica: str


@dataclass(frozen=True)
class StateReset:
    """The request moved to new_replica, whose probes start without its earlier tokens."""

    request_id: str
    old_replica: str | None
    new_replica: str
    reason: str


@dataclass(frozen=True)
class Unavailable:
    """No replica has been reachable for the request since `since` (time.monotonic()),
    for at least router_timeout_s. Sent once per outage."""

    request_id: str
    since: float


LinkEvent = Union[Scores, Abort, Processed, RequestFailed, StateReset, Unavailable]


@dataclass(frozen=True)
class RequestStats:
    """What was lost on the way to the routers, for GenerateFinished."""

    dropped_records: int
    unprobed_tokens: int


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "undercurrent_router_link_"
        self.batches_sent = Counter(
            p + "batches_sent", "ActivationBatches written", ["replica"], registry=registry
        )
        self.bytes_sent = Counter(
            p + "bytes_sent", "ActivationBatch bytes written", ["replica"], registry=registry
        )
        self.dropped_batches = Counter(
            p + "dropped_batches", "Batches dropped before sending", ["reason"], registry=registry
        )
        self.dropped_records = Counter(
            p + "dropped_records",
            "Activation rows dropped before sending",
            ["reason"],
            registry=registry,
        )
        self.unprobed_tokens = Counter(
            p + "unprobed_tokens", "Tokens whose rows had no reachable replica", registry=registry
        )
        self.reconnects = Counter(
            p + "reconnects", "Sessions re-established after a loss", ["replica"], registry=registry
        )
        self.rehomed = Counter(
            p + "rehomed_requests", "Requests moved to another replica", registry=registry
        )
        self.replicas_up = Gauge(
            p + "replicas_up", "Replicas with a live Session", registry=registry
        )
        self.ack_latency = Histogram(
            p + "ack_latency_seconds",
            "Batch written to StepAck received",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )


# Several links may share one registry (e.g. the default one): they share its metrics.
_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = weakref.WeakKeyDictionary()


def _metrics_for(registry: CollectorRegistry) -> _Metrics:
    if registry not in _METRICS:
        _METRICS[registry] = _Metrics(registry)
    return _METRICS[registry]


# ---------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address host resolves to, as "addr:port" ("[v6]:port"), via the stdlib resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({routing.join_host_port(info[4][0], port) for info in infos})


# ---------------------------------------------------------------------------
# The link
# ---------------------------------------------------------------------------


class _SessionLost(Exception):
    pass


# Owner key for rows of requests the link does not know (never started, or ended).
_NOT_STARTED = ""


@dataclass(eq=False)
class _Replica:
    address: str
    queue: SendQueue
    up: bool = False
    draining: bool = False
    drain_reason: str = ""
    ever_up: bool = False
    probes: dict[str, pb.ProbeInfo] = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)
    ledger: StepLedger = field(default_factory=StepLedger)
    last_received: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    @property
    def eligible(self) -> bool:
        """Takes new (and re-homed) requests."""
        return self.up and not self.draining


@dataclass(eq=False)
class _Request:
    request_id: str
    bindings: list[pb.ProbeBinding]
    prompt_length: int
    replica: _Replica | None = None
    last_replica: str | None = None  # where it was last homed, even while unhomed
    unavailable_since: float | None = None
    unavailable_reported: bool = False
    dropped_records: int = 0
    unprobed_tokens: int = 0
    processed_position: int = -1


class RouterLink:
    """Sessions to every router replica, request assignment, and the events back."""

    def __init__(
        self,
        config: RouterLinkConfig,
        model: pb.ModelInfo,
        on_event: Callable[[LinkEvent], None],
        registry: CollectorRegistry | None = None,
        resolver: Resolver = resolve_dns,
    ) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = _metrics_for(self.registry)
        self._hello = pb.SessionRequest(
            hello=pb.SessionHello(engine_id=config.engine_id, model=model)
        )
        self._on_event = on_event
        self._resolver = resolver
        self._targets = routing.parse_targets(config.targets)
        self._replicas: dict[str, _Replica] = {}
        self._requests: dict[str, _Request] = {}
        self._tasks: list[asyncio.Task] = []
        self._change_waiters: list[asyncio.Future] = []
        self._closing = False

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Resolves targets and starts connecting; does not wait for any replica."""
        if isinstance(self._targets, routing.StaticTargets):
            self._set_members(self._targets.addresses)
        else:
            await self._refresh_dns()
            self._tasks.append(asyncio.create_task(self._dns_loop(), name="router-link-dns"))
        self._tasks.append(asyncio.create_task(self._watchdog(), name="router-link-watchdog"))

    async def wait_ready(self, replicas: int = 1, timeout: float | None = None) -> None:
        """Waits until at least `replicas` replicas are up (raises TimeoutError)."""
        async with asyncio.timeout(timeout):
            while len(self.replicas_up()) < replicas:
                waiter = asyncio.get_running_loop().create_future()
                self._change_waiters.append(waiter)
                await waiter

    async def close(self) -> None:
        """Flushes queues, half-closes every stream, waits for routers to end them."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self._replicas.values():
            if replica.up:
                replica.wake.set()  # its writer flushes, then half-closes
            elif replica.task:
                replica.task.cancel()  # connecting or backing off: nothing to flush
        sessions = [r.task for r in self._replicas.values() if r.task]
        if not sessions:
            return
        _, pending = await asyncio.wait(sessions, timeout=self.config.close_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)

    # -- requests (never block) --------------------------------------------

    def start_request(
        self, request_id: str, bindings: list[pb.ProbeBinding], prompt_length: int
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already started on the router link")
        request = _Request(request_id, list(bindings), prompt_length)
        self._requests[request_id] = request
        self._home(request, reason="start")

    def send_step(self, blocks: list[Block]) -> None:
        """Queues one engine step's merged blocks: one batch per replica (more if too big).

        Rows of requests not started here (or already ended) are ignored; rows
        of requests with no reachable replica count as unprobed tokens.
        """

        def owner_of(request_id: str) -> str | None:
            request = self._requests.get(request_id)
            if request is None:
                return _NOT_STARTED
            return request.replica.address if request.replica else None

        for address, part in routing.partition_by_owner(blocks, owner_of).items():
            if address == _NOT_STARTED:
                continue
            if address is None:
                for request_id, tokens in routing.distinct_positions(part).items():
                    self._requests[request_id].unprobed_tokens += tokens
                    self._metrics.unprobed_tokens.inc(tokens)
                continue
            self._queue_batches(self._replicas[address], part)

    def end_request(self, request_id: str, finish_reason: int) -> RequestStats:
        """Queues request_end behind the request's batches; returns its loss counts."""
        request = self._requests.pop(request_id)
        if request.replica is not None:
            request.replica.requests.discard(request_id)
            self._send_control(
                request.replica,
                pb.SessionRequest(
                    request_end=pb.RequestEnd(request_id=request_id, finish_reason=finish_reason)
                ),
            )
        return RequestStats(request.dropped_records, request.unprobed_tokens)

    # -- queries ------------------------------------------------------------

    def catalog(self) -> dict[str, pb.ProbeInfo]:
        """Probes offered by replicas that take requests (up, not draining)."""
        result: dict[str, pb.ProbeInfo] = {}
        for replica in sorted(self._replicas.values(), key=lambda r: r.address):
            if replica.eligible:
                for name, info in replica.probes.items():
                    result.setdefault(name, info)
        return result

    def replicas_up(self) -> list[str]:
        return sorted(a for a, r in self._replicas.items() if r.up)

    def replica_of(self, request_id: str) -> str | None:
        replica = self._requests[request_id].replica
        return replica.address if replica else None

    def is_backpressured(self, request_id: str) -> bool:
        """True while the request's replica queue is full: pause the request."""
        replica = self._requests[request_id].replica
        return replica is not None and replica.queue.is_full()

    def dropped_records(self, request_id: str) -> int:
        return self._requests[request_id].dropped_records

    def unprobed_tokens(self, request_id: str) -> int:
        return self._requests[request_id].unprobed_tokens

    def unavailable_since(self, request_id: str) -> float | None:
        """time.monotonic() when the request lost its last reachable replica, or None."""
        return self._requests[request_id].unavailable_since

    def processed_position(self, request_id: str) -> int:
        """Highest token position acknowledged for the request; -1 before any."""
        return self._requests[request_id].processed_position

    # -- assignment ---------------------------------------------------------

    def _home(self, request: _Request, reason: str) -> None:
        """Places a request that has no replica; without any replica to take it,
        starts its outage clock. A request that was homed before, or whose rows
        went unprobed, starts over with state_reset=True and a StateReset event."""
        eligible = [a for a, r in self._replicas.items() if r.eligible]
        address = routing.pick_replica(request.request_id, eligible)
        if address is None:
            request.replica = None
            if request.unavailable_since is None:
                request.unavailable_since = time.monotonic()
            return
        replica = self._replicas[address]
        state_reset = request.last_replica is not None or request.unprobed_tokens > 0
        old = request.last_replica
        request.replica = replica
        request.last_replica = address
        request.unavailable_since = None
        request.unavailable_reported = False
        replica.requests.add(request.request_id)
        self._send_control(
            replica,
            pb.SessionRequest(
                request_start=pb.RequestStart(
                    request_id=request.request_id,
                    probes=request.bindings,
                    prompt_length=request.prompt_length,
                    state_reset=state_reset,
                )
            ),
        )
        if state_reset:
            self._metrics.rehomed.inc()
            self._emit(StateReset(request.request_id, old, address, reason))

    def _emit(self, event: LinkEvent) -> None:
        try:
            self._on_event(event)
        except Exception:
            log.exception("router link event handler failed on %r", event)

    # -- queues -------------------------------------------------------------

    def _send_control(self, replica: _Replica, message: pb.SessionRequest) -> None:
        replica.queue.put_control(message)
        replica.wake.set()

    def _queue_batches(self, replica: _Replica, blocks: list[Block]) -> None:
        try:
            parts = routing.split_by_size(blocks, self.config.max_message_bytes)
        except routing.RowTooLarge as err:
            log.error("dropping a step for %s: %s", replica.address, err)
            self._count_dropped(routing.rows_per_request(blocks), "too_large")
            return
        for part in parts:
            message = pb.SessionRequest()
            message.batch.CopyFrom(to_batch(part))
            item = QueuedBatch(
                message,
                message.ByteSize(),
                routing.rows_per_request(part),
                routing.max_positions(part),
            )
            for dropped in replica.queue.put_batch(item):
                self._count_dropped(dropped.rows, self.config.overflow_policy.value)
        replica.wake.set()

    def _count_dropped(self, rows: dict[str, int], reason: str) -> None:
        self._metrics.dropped_batches.labels(reason).inc()
        self._metrics.dropped_records.labels(reason).inc(sum(rows.values()))
        for request_id, count in rows.items():
            if request_id in self._requests:
                self._requests[request_id].dropped_records += count

    # -- membership ---------------------------------------------------------

    def _set_members(self, addresses: list[str] | tuple[str, ...]) -> None:
        wanted = set(addresses)
        for address in sorted(wanted - self._replicas.keys()):
            replica = _Replica(
                address,
                SendQueue(
                    self.config.queue_max_batches,
                    self.config.queue_max_bytes,
                    self.config.overflow_policy,
                ),
            )
            self._replicas[address] = replica
            replica.task = asyncio.create_task(
                self._run_replica(replica), name=f"router-session-{address}"
            )
            log.info("router replica %s added", address)
        for address in sorted(self._replicas.keys() - wanted):
            replica = self._replicas[address]
            if replica.task:
                replica.task.cancel()
            self._mark_down(replica, "removed from DNS")
            del self._replicas[address]
            log.info("router replica %s removed", address)

    async def _refresh_dns(self) -> None:
        target = self._targets
        try:
            addresses = await self._resolver(target.host, target.port)
        except Exception as err:  # a resolver outage must not end the refresh loop
            log.warning(
                "resolving %s:%d failed (%s); keeping %d replicas",
                target.host,
                target.port,
                err,
                len(self._replicas),
            )
            return
        self._set_members(addresses)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_refresh_s)
            await self._refresh_dns()

    async def _watchdog(self) -> None:
        """Turns a long outage into one Unavailable event per request."""
        tick = max(0.01, self.config.router_timeout_s / 5)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for request in list(self._requests.values()):
                since = request.unavailable_since
                if since is None or request.unavailable_reported:
                    continue
                if now - since >= self.config.router_timeout_s:
                    request.unavailable_reported = True
                    self._emit(Unavailable(request.request_id, since))

    def _notify_change(self) -> None:
        waiters, self._change_waiters = self._change_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- one replica --------------------------------------------------------

    async def _run_replica(self, replica: _Replica) -> None:
        """Keeps one Session open to a replica, reconnecting with jittered backoff."""
        attempt = 0
        while not self._closing:
            try:
                await self._session(replica)
                reason = "stream ended"
            except asyncio.CancelledError:
                self._mark_down(replica, "cancelled")
                raise
            except (aio.AioRpcError, _SessionLost, TimeoutError) as err:
                reason = _describe(err)
            except Exception as err:  # never let one replica's bug end its loop
                log.exception("router session %s failed", replica.address)
                reason = _describe(err)
            was_up = replica.up
            self._mark_down(replica, reason)
            if self._closing:
                return
            attempt = 0 if was_up else attempt + 1
            delay = routing.backoff_delay(
                attempt, self.config.reconnect_base_s, self.config.reconnect_max_s, random.random()
            )
            log.info(
                "router session %s down (%s); retrying in %.2fs", replica.address, reason, delay
            )
            await asyncio.sleep(delay)

    async def _session(self, replica: _Replica) -> None:
        channel = aio.insecure_channel(
            replica.address, options=channel_options(self.config.max_message_bytes)
        )
        call = undercurrent_pb2_grpc.ProbeRouterServiceStub(channel).Session()
        tasks: list[asyncio.Task] = []
        try:
            async with asyncio.timeout(self.config.heartbeat_timeout_s):
                await call.write(self._hello)
                first = await call.read()
            if first is aio.EOF or not first.HasField("hello"):
                raise _SessionLost("router did not answer hello")
            self._mark_up(replica, first.hello)
            reader = asyncio.create_task(self._read_loop(replica, call))
            tasks = [
                reader,
                asyncio.create_task(self._write_loop(replica, call)),
                asyncio.create_task(self._liveness_loop(replica)),
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

    async def _read_loop(self, replica: _Replica, call) -> None:
        while True:
            message = await call.read()
            if message is aio.EOF:
                return
            replica.last_received = time.monotonic()
            self._on_router_message(replica, message)

    async def _write_loop(self, replica: _Replica, call) -> None:
        """Drains the replica's queue into the stream; on close, flushes and half-closes."""
        while True:
            while not replica.queue:
                if self._closing:
                    await call.done_writing()
                    return
                replica.wake.clear()
                await replica.wake.wait()
            item = replica.queue.pop()
            if not isinstance(item, QueuedBatch):
                await call.write(item)
                continue
            item.message.batch.step = replica.ledger.record(item.positions, time.monotonic())
            try:
                await call.write(item.message)
            except BaseException:  # failed or cancelled with the session: never sent
                self._count_dropped(item.rows, "replica_down")
                raise
            self._metrics.batches_sent.labels(replica.address).inc()
            self._metrics.bytes_sent.labels(replica.address).inc(item.nbytes)

    async def _liveness_loop(self, replica: _Replica) -> None:
        interval = self.config.heartbeat_interval_s
        timeout = self.config.heartbeat_timeout_s
        tick = min(interval, timeout / 4)
        next_heartbeat = time.monotonic()
        while True:
            now = time.monotonic()
            if now - replica.last_received > timeout:
                raise _SessionLost(f"no message for {now - replica.last_received:.2f}s")
            if now >= next_heartbeat and not self._closing:
                self._send_control(
                    replica,
                    pb.SessionRequest(heartbeat=pb.Heartbeat(sent_unix_nanos=time.time_ns())),
                )
                next_heartbeat = now + interval
            await asyncio.sleep(tick)

    def _on_router_message(self, replica: _Replica, message: pb.SessionResponse) -> None:
        kind = message.WhichOneof("message")
        if kind == "scores":
            self._emit(Scores(message.scores.request_id, message.scores, replica.address))
        elif kind == "abort":
            self._emit(Abort(message.abort.request_id, message.abort, replica.address))
        elif kind == "ack":
            acked = replica.ledger.ack(message.ack.step)
            now = time.monotonic()
            for sent in acked.sent_at:
                self._metrics.ack_latency.observe(now - sent)
            for request_id, position in acked.positions.items():
                request = self._requests.get(request_id)
                if request is not None:
                    request.processed_position = max(request.processed_position, position)
                self._emit(Processed(request_id, position, replica.address))
        elif kind == "error":
            self._emit(RequestFailed(message.error.request_id, message.error, replica.address))
        elif kind == "catalog":
            replica.probes = {p.name: p for p in message.catalog.probes}
        elif kind == "hello":
            replica.probes = {p.name: p for p in message.hello.probes}
        elif kind == "drain":
            self._on_drain(replica, message.drain.reason)

    def _mark_up(self, replica: _Replica, hello: pb.RouterHello) -> None:
        if replica.ever_up:
            self._metrics.reconnects.labels(replica.address).inc()
        replica.up = replica.ever_up = True
        replica.draining = False
        replica.probes = {p.name: p for p in hello.probes}
        replica.ledger = StepLedger()
        replica.last_received = time.monotonic()
        self._metrics.replicas_up.inc()
        log.info(
            "router replica %s up (%s, %d probes)",
            replica.address,
            hello.router_id,
            len(replica.probes),
        )
        for request in sorted(self._requests.values(), key=lambda r: r.request_id):
            if request.replica is None:
                self._home(request, reason=f"{replica.address} up")
        self._move_off_draining()
        self._notify_change()

    def _mark_down(self, replica: _Replica, reason: str) -> None:
        if replica.up:
            self._metrics.replicas_up.dec()
            log.warning("router replica %s down: %s", replica.address, reason)
        replica.up = False
        for lost in replica.queue.clear():
            self._count_dropped(lost.rows, "replica_down")
        moved = sorted(replica.requests)
        replica.requests.clear()
        if self._closing:
            return
        for request_id in moved:
            request = self._requests[request_id]
            request.replica = None
            self._home(request, f"{replica.address} down: {reason}")
        self._notify_change()

    def _on_drain(self, replica: _Replica, reason: str) -> None:
        """Takes no new requests there; its requests move as soon as another replica can."""
        replica.draining = True
        replica.drain_reason = reason
        log.info("router replica %s draining (%s)", replica.address, reason)
        self._move_off_draining()
        self._notify_change()

    def _move_off_draining(self) -> None:
        """Re-homes requests of draining replicas while an eligible replica exists,
        ending them on the draining one so it can finish sooner."""
        if not any(r.eligible for r in self._replicas.values()):
            return  # nowhere better: they stay where they are
        for replica in list(self._replicas.values()):
            if not (replica.up and replica.draining):
                continue
            for request_id in sorted(replica.requests):
                replica.requests.discard(request_id)
                self._send_control(
                    replica,
                    pb.SessionRequest(
                        request_end=pb.RequestEnd(
                            request_id=request_id, finish_reason=pb.FINISH_REASON_UNSPECIFIED
                        )
                    ),
                )
                request = self._requests[request_id]
                request.replica = None
                self._home(request, f"{replica.address} draining: {replica.drain_reason}")


def _describe(err: BaseException) -> str:
    if isinstance(err, aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
