"""The engine's connection to its probe routers: one ReplicaSession per replica.

The engine's drain loop calls start_request / send_step / end_request; none of
them awaits the network. Requests are known by the engine's run key, which is
also the request id routers see. Each request lives on one replica, chosen by
rendezvous hashing over the replicas that serve its bindings at the versions
they were pinned to (`assignment`); when that replica goes down or drains, the
request is re-homed (request_start with state_reset=True), and a stateful
binding whose probe state held rows of it starts afresh there: the ledger
decides what that means under the binding's policy. A request whose stateful
state lives on a draining replica stays there.

Every row the link is handed is entered in the request's RequestLedger
(engine_service.request.ledger) as it is queued, sent, acknowledged, dropped,
lost, refused, errored or timed out; the engine reads the ledger to gate tokens,
apply failure policies and count losses. What the routers send back reaches
the engine as LinkEvent values through one callback, in the order each router
sent them (so a verdict caused by step N arrives before the Processed event of
ack N). A router-wide notice (an error naming neither a request nor a step,
such as an incompatible probe in its catalog) is logged and counted, never
taken as a failure of the requests on that replica.

Router messages about a request are accepted only from a replica that got the
request's request_start and is still connected, and only with the live run's
incarnation echoed.

All methods must be called from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.activations import Block, batch_bytes
from common.errors import status_code_name
from engine_service.link import batching
from engine_service.link.assignment import Catalog, Wanted, choose_home, pin_versions
from engine_service.link.config import RouterLinkConfig
from engine_service.link.events import (
    Abort,
    Failed,
    LinkEvent,
    Processed,
    Scores,
    StateRestarted,
    Unavailable,
    Unscored,
)
from engine_service.link.metrics import metrics_for
from engine_service.link.send_queue import QueuedBatch
from engine_service.link.session import ReplicaSession
from common.router_targets import Resolver, StaticTargets, parse_targets, resolve_dns
from engine_service.request.ledger import Failure, RequestLedger

log = logging.getLogger(__name__)

# Owner key for rows of requests the link does not know (never started, or ended).
_NOT_STARTED = ""


@dataclass(eq=False)
class _Request:
    request_id: str
    incarnation: int
    bindings: Sequence[session_pb.SessionBinding]  # kept as given (the engine's: one repeated field)
    prompt_tokens: int
    ledger: RequestLedger
    caller: str = ""  # the authenticated caller, for the routers' verdict logs
    replica: ReplicaSession | None = None
    last_replica: str | None = None  # where it was last homed, even while unhomed
    # Replicas that got this run's request_start on their current session: the
    # owner, and a draining former owner still finishing the rows it got.
    homes: set[str] = field(default_factory=set)
    # Former owners it was ended on while it goes on elsewhere: what they say
    # about the run as a whole concerns only the rows still in flight there
    # (their answer to request_end concerns none).
    ended_on: set[str] = field(default_factory=set)
    unavailable_since: float | None = None
    unavailable_reported: bool = False


class RouterLink:
    """Sessions to every router replica, request assignment, and the events back."""

    def __init__(
        self,
        config: RouterLinkConfig,
        model: types_pb.ModelInfo,
        on_event: Callable[[LinkEvent], None],
        registry: CollectorRegistry | None = None,
        resolver: Resolver = resolve_dns,
        clock: Callable[[], float] = time.monotonic,
        session_factory: Callable[..., ReplicaSession] = ReplicaSession,
    ) -> None:
        """`clock` times rows in flight and outages (the router timeout counts on
        it); `session_factory` makes one replica's session (ReplicaSession's
        arguments), which a simulation replaces."""
        self.config = config
        self._clock = clock
        self._session_factory = session_factory
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = metrics_for(self.registry)
        self._metrics.links.add(self)
        self._hello = session_pb.SessionRequest(
            hello=session_pb.SessionHello(engine_id=config.engine_id, model=model, accepts_replies=True)
        )
        self._on_event = on_event
        self._resolver = resolver
        self._targets = parse_targets(config.targets)
        self._replicas: dict[str, ReplicaSession] = {}
        self._requests: dict[str, _Request] = {}
        self._tasks: list[asyncio.Task] = []
        self._change_waiters: list[asyncio.Future] = []
        self._closing = False

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Resolves targets and starts connecting; does not wait for any replica."""
        if isinstance(self._targets, StaticTargets):
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
            replica.close()
        sessions = [r.task for r in self._replicas.values() if r.task]
        if not sessions:
            return
        _, pending = await asyncio.wait(sessions, timeout=self.config.close_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)

    # -- requests (never block) --------------------------------------------

    def pin(self, request_id: str, wanted: Sequence[Wanted]) -> list[types_pb.ProbeInfo]:
        """The probe versions a new request is bound to: those of the replica it
        will live on (`assignment.pin_versions`)."""
        return pin_versions(request_id, self.catalogs(), wanted)

    def start_request(
        self,
        request_id: str,
        incarnation: int,
        bindings: Sequence[session_pb.SessionBinding],
        prompt_tokens: int,
        ledger: RequestLedger,
        caller: str = "",
    ) -> None:
        """Homes the request on a replica (request_start). `bindings` is kept, not
        copied, until the request ends: it goes out again if the request is re-homed."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already started on the router link")
        request = _Request(request_id, incarnation, bindings, prompt_tokens, ledger, caller)
        self._requests[request_id] = request
        self._home(request, reason="start")

    def send_step(self, blocks: list[Block]) -> None:
        """Queues one engine step's merged blocks: one batch per replica (more if too big).

        Rows of requests not started here (or already ended) are ignored; rows
        of requests with no reachable replica are dropped (and unscored).
        """

        def owner_of(request_id: str) -> str | None:
            request = self._requests.get(request_id)
            if request is None:
                return _NOT_STARTED
            return request.replica.address if request.replica else None

        now = self._clock()
        for address, part in batching.partition_by_owner(blocks, owner_of).items():
            if address == _NOT_STARTED:
                continue
            if address is None:
                self._not_sent(part, now, "no_replica", "no router replica was reachable")
                continue
            self._queue_batches(self._replicas[address], part, now)

    def end_request(self, request_id: str, finish_reason: int) -> None:
        """Queues request_end behind the request's batches."""
        request = self._requests.pop(request_id, None)
        if request is None or request.replica is None:
            return
        request.replica.requests.discard(request_id)
        request.replica.send_control(
            session_pb.SessionRequest(
                request_end=session_pb.RequestEnd(
                    request_id=request_id,
                    finish_reason=finish_reason,
                    incarnation=request.incarnation,
                )
            )
        )

    # -- queries ------------------------------------------------------------

    def catalogs(self) -> dict[str, Catalog]:
        """The probes of each replica that takes requests (up, not draining)."""
        return {address: replica.probes for address, replica in sorted(self._replicas.items())
                if replica.eligible}

    def replicas_up(self) -> list[str]:
        return sorted(a for a, r in self._replicas.items() if r.up)

    def replica_of(self, request_id: str) -> str | None:
        replica = self._requests[request_id].replica
        return replica.address if replica else None

    def unavailable_since(self, request_id: str) -> float | None:
        """When (on the link's clock) the request lost its last reachable replica, or None."""
        return self._requests[request_id].unavailable_since

    def live_requests(self) -> int:
        return len(self._requests)

    def rows_in_flight(self) -> int:
        """Probe rows of live requests queued or sent and not yet acknowledged or failed."""
        return sum(request.ledger.in_flight() for request in list(self._requests.values()))

    # -- assignment ---------------------------------------------------------

    def _home(self, request: _Request, reason: str) -> None:
        """Places a request that has no replica; without any replica to take it,
        the request waits unhomed (its rows are dropped) and the watchdog counts."""
        wanted = [Wanted(b.probe, b.digest, b.failure_policy == types_pb.FAILURE_POLICY_FAIL_CLOSED)
                  for b in request.bindings]
        address = choose_home(request.request_id, self.catalogs(), wanted)
        if address is None:
            request.replica = None
            if request.unavailable_since is None:
                request.unavailable_since = self._clock()
            return
        replica = self._replicas[address]
        state_reset = request.last_replica is not None or bool(request.ledger.failures)
        request.replica = replica
        request.last_replica = address
        request.homes.add(address)
        request.ended_on.discard(address)
        request.unavailable_since = None
        request.unavailable_reported = False
        replica.requests.add(request.request_id)
        request.ledger.homed(address)
        replica.send_control(
            session_pb.SessionRequest(
                request_start=session_pb.RequestStart(
                    request_id=request.request_id,
                    bindings=request.bindings,
                    prompt_tokens=request.prompt_tokens,
                    state_reset=state_reset,
                    incarnation=request.incarnation,
                    caller=request.caller,
                )
            )
        )
        if state_reset:
            self._metrics.rehomed.inc()
            log.warning("request %s re-homed to %s: %s", request.request_id, address, reason)
            failure, restarted = request.ledger.rehomed(address, reason)
            self._unscored(request, failure, "state_lost")
            if restarted and self._live(request):
                self._emit(StateRestarted(request.request_id, request.incarnation, tuple(restarted),
                                          f"re-homed to {address} ({reason})"))

    def _emit(self, event: LinkEvent) -> None:
        """Hands the engine an event. Its handler must not raise: one that does
        has lost track of the request, which the engine is told to end."""
        try:
            self._on_event(event)
        except Exception as err:
            log.exception("router link event handler failed on %r", event)
            if not isinstance(event, Failed):
                self._emit(Failed(event.request_id, event.incarnation,
                                  f"engine error handling {type(event).__name__}: {type(err).__name__}: {err}"))

    def _live(self, request: _Request) -> bool:
        return self._requests.get(request.request_id) is request

    def _unscored(self, request: _Request, failure: Failure | None, kind: str) -> None:
        if failure is None:
            return
        self._metrics.unscored_records.labels(kind).inc(failure.rows)
        if self._live(request):
            self._emit(Unscored(request.request_id, request.incarnation, failure))

    # -- queues -------------------------------------------------------------

    def _not_sent(self, blocks: list[Block], now: float, kind: str, reason: str) -> None:
        rows = batching.rows_by_point(blocks)
        self._metrics.dropped_batches.labels(kind).inc()
        self._metrics.dropped_records.labels(kind).inc(
            sum(len(p) for points in rows.values() for p in points.values()))
        for request_id, points in rows.items():
            request = self._requests[request_id]
            self._unscored(request, request.ledger.not_sent(points, now, reason), kind)

    def _queue_batches(self, replica: ReplicaSession, blocks: list[Block], now: float) -> None:
        try:
            parts = batching.split_by_size(blocks, self.config.max_message_bytes)
        except batching.RowTooLarge as err:
            log.error("dropping a step for %s: %s", replica.address, err)
            self._not_sent(blocks, now, "too_large", f"dropped before sending: {err}")
            return
        for part in parts:
            # Rows not copied, unless they would keep much more than themselves alive
            # while queued; the step number is added as the batch is written.
            data = batch_bytes(batching.holding_little_else(part))
            entries = []
            for request_id, points in batching.rows_by_point(part).items():
                request = self._requests[request_id]
                entries.append((request, request.ledger.queued(replica.address, points, now)))
            batch = QueuedBatch(data, data.nbytes, sum(b.num_rows for b in part), entries)
            for dropped in replica.send_batch(batch):
                self._drop(dropped, self.config.overflow_policy.value)

    def _drop(self, batch: QueuedBatch, kind: str) -> None:
        self._metrics.dropped_batches.labels(kind).inc()
        self._metrics.dropped_records.labels(kind).inc(batch.rows)
        for request, message in batch.entries:
            failure = request.ledger.dropped(message, f"rows dropped before reaching a router ({kind})")
            self._unscored(request, failure, kind)

    # -- what sessions report (SessionListener) ------------------------------

    def session_up(self, replica: ReplicaSession) -> None:
        for request in sorted(self._requests.values(), key=lambda r: r.request_id):
            if request.replica is None:
                self._home(request, reason=f"{replica.address} up")
        self._move_off_draining()
        self._notify_change()

    def session_down(self, replica: ReplicaSession, reason: str, unsent: list[QueuedBatch]) -> None:
        for batch in unsent:
            self._drop(batch, "replica_down")
        # Rows the replica got but did not acknowledge are lost with its session,
        # and so is its knowledge of every request it was sent.
        for request in list(self._requests.values()):
            if replica.address in request.homes:
                request.homes.discard(replica.address)
                failure = request.ledger.replica_failed(
                    replica.address, f"router {replica.address} lost before acknowledging: {reason}"
                )
                self._unscored(request, failure, "replica_down")
        moved = sorted(replica.requests)
        replica.requests.clear()
        if self._closing:
            return
        for request_id in moved:
            request = self._requests[request_id]
            request.replica = None
            self._home(request, f"{replica.address} down: {reason}")
        self._notify_change()

    def batch_sent(self, replica: ReplicaSession, batch: QueuedBatch, step: int) -> None:
        for request, message in batch.entries:
            request.ledger.sent(message, step)

    def batch_unsent(self, replica: ReplicaSession, batch: QueuedBatch) -> None:
        self._drop(batch, "replica_down")

    def steps_acked(self, replica: ReplicaSession, batches: list[QueuedBatch]) -> None:
        processed: dict[int, _Request] = {}
        for batch in batches:
            for request, message in batch.entries:
                if request.ledger.acknowledged(message):
                    processed[id(request)] = request
        for request in processed.values():
            if self._live(request):
                self._emit(Processed(request.request_id, request.incarnation, replica.address))

    def request_message(self, replica: ReplicaSession, message: session_pb.SessionResponse) -> None:
        kind = message.WhichOneof("message")
        if kind == "scores":
            scores = message.scores.probe_scores
            request = self._match(replica, scores.request_id, message.scores.incarnation, kind)
            if request is not None:
                self._emit(Scores(request.request_id, request.incarnation, scores, replica.address))
        elif kind == "abort":
            verdict = message.abort.verdict
            request = self._match(replica, verdict.request_id, message.abort.incarnation, kind)
            if request is not None:
                self._emit(Abort(request.request_id, request.incarnation, verdict, replica.address))
        elif kind == "error":
            self._on_error(replica, message.error)

    def draining(self, replica: ReplicaSession) -> None:
        self._move_off_draining()
        self._notify_change()

    def _match(
        self, replica: ReplicaSession, request_id: str, incarnation: int, kind: str
    ) -> _Request | None:
        """The live request run a router message is about, or None (counted): the
        router must have been given the run and echo its incarnation."""
        request = self._requests.get(request_id)
        if request is None:
            reason = "unknown_request"
        elif replica.address not in request.homes:
            reason = "not_its_replica"
        elif incarnation != request.incarnation:
            reason = "stale_incarnation"
        else:
            return request
        self._metrics.ignored_messages.labels(reason).inc()
        log.debug("ignoring %s from %s for %r: %s", kind, replica.address, request_id, reason)
        return None

    def _on_error(self, replica: ReplicaSession, error: session_pb.RequestError) -> None:
        """A router error makes the rows it concerns unscored: one step of one
        request, one step of every request in it, or a whole request run."""
        code = status_code_name(error.code)
        self._metrics.router_errors.labels(code).inc()
        probe = error.probe or None
        text = (
            f"router {replica.address} error"
            + (f" for probe {error.probe!r}" if error.probe else "")
            + f": {code}: {error.message}"
        )
        log.warning("%s (request %r, step %d)", text, error.request_id, error.step)
        if error.request_id:
            request = self._match(replica, error.request_id, error.incarnation, "error")
            if request is None:
                return
            if error.step:
                failure = request.ledger.step_failed(replica.address, error.step, text, probe)
            else:
                failure = request.ledger.refused(replica.address, text, probe,
                                                 home=replica.address not in request.ended_on)
            self._unscored(request, failure, "router_error")
            return
        if error.step:
            batch = replica.steps.batch_of(error.step)
            concerned = [r for r, _ in batch.entries] if batch else []
            for request in concerned:
                failure = request.ledger.step_failed(replica.address, error.step, text, probe)
                self._unscored(request, failure, "router_error")
            return
        # Neither request nor step: a notice about the router (an incompatible
        # probe in its catalog, say), logged and counted above; it concerns no
        # request's rows.

    # -- membership ---------------------------------------------------------

    def _set_members(self, addresses: list[str] | tuple[str, ...]) -> None:
        wanted = set(addresses)
        for address in sorted(wanted - self._replicas.keys()):
            replica = self._session_factory(address, self.config, self._hello, self, self._metrics)
            self._replicas[address] = replica
            replica.start()
            log.info("router replica %s added", address)
        for address in sorted(self._replicas.keys() - wanted):
            replica = self._replicas.pop(address)
            if replica.task:
                replica.task.cancel()
            replica.mark_down("removed from DNS")
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
        """Rows left unacknowledged for router_timeout_s go unscored (a router
        that is silent but connected); a request with no replica that long gets
        one Unavailable event per outage."""
        timeout = self.config.router_timeout_s
        tick = max(0.01, timeout / 5)
        last = self._clock()
        while True:
            await asyncio.sleep(tick)
            now = self._clock()
            stalled, last = now - last > 2 * tick, now
            if stalled:
                # The event loop itself was blocked: acks may sit unread in the
                # sockets. Let the readers run before judging any router.
                continue
            try:
                self._check_timeouts(now, timeout)
            except Exception:  # the watchdog must outlive any one bad request
                log.exception("router link watchdog failed")

    def _check_timeouts(self, now: float, timeout: float) -> None:
        for request in list(self._requests.values()):
            try:
                self._check_timeout(request, now, timeout)
            except Exception as err:  # one request's bad state must not stop the others' checks
                log.exception("router link watchdog failed for request %s", request.request_id)
                if self._live(request):
                    self._emit(Failed(request.request_id, request.incarnation,
                                      f"engine error checking router timeouts: {type(err).__name__}: {err}"))

    def _check_timeout(self, request: _Request, now: float, timeout: float) -> None:
        oldest = request.ledger.oldest_in_flight()
        if oldest is not None and now - oldest >= timeout:
            where = request.replica.address if request.replica else "(none)"
            failure = request.ledger.expire(
                now - timeout,
                f"router {where} acknowledged no rows for {timeout:g} s (router timeout)",
            )
            self._unscored(request, failure, "timeout")
        since = request.unavailable_since
        if since is None or request.unavailable_reported or not self._live(request):
            return
        if now - since >= timeout:
            request.unavailable_reported = True
            self._emit(Unavailable(request.request_id, request.incarnation, since, now - since))

    def _notify_change(self) -> None:
        waiters, self._change_waiters = self._change_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _move_off_draining(self) -> None:
        """Re-homes requests of draining replicas while an eligible replica exists,
        ending them on the draining one so it can finish sooner."""
        if not any(r.eligible for r in self._replicas.values()):
            return  # nowhere better: they stay where they are
        for replica in list(self._replicas.values()):
            if not (replica.up and replica.draining):
                continue
            for request_id in sorted(replica.requests):
                request = self._requests[request_id]
                if request.ledger.holds_state_on(replica.address):
                    continue  # its stateful probes' state is there: it finishes there
                replica.requests.discard(request_id)
                request.ended_on.add(replica.address)
                replica.send_control(
                    session_pb.SessionRequest(
                        request_end=session_pb.RequestEnd(
                            request_id=request_id,
                            finish_reason=types_pb.FINISH_REASON_UNSPECIFIED,
                            incarnation=request.incarnation,
                        )
                    )
                )
                request.replica = None
                self._home(request, f"{replica.address} draining: {replica.drain_reason}")
