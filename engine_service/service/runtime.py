"""The engine: vLLM's AsyncLLM, activation capture and the router link joined.

One drain loop runs beside vLLM's busy loop: after every step it drains the
workers' capture buffers (vLLM's workers push them), streams client-requested
records back in-band and hands probe records to the router link, whose sends
never wait on the network. Router verdicts come back as link events and become
AsyncLLM.abort calls, which vLLM's single scheduler applies on every rank at
the next step.

This module orchestrates; it decides nothing about a request. Each run of a
request is a `RequestRun` (engine_service.request.run), known by its run key
in vLLM, capture, the router link and the routers alike: the runtime hands it
vLLM's tokens, the link's events and capture's errors, and applies the `Stop`
a run returns by aborting it in vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import AsyncIterator

from common import activations
from common.capture_spec import parse_points
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    Unavailable,
)
from engine_service import link as links
from engine_service.capture.driver.controller import CaptureController, require_prompt_computation
from engine_service.engine_core.tokens_ahead import AllowancePublisher
from engine_service.link.batching import partition_by_owner
from engine_service.request import bindings as pins
from engine_service.request import guards as operator_guards
from engine_service.request import validation as reqs
from engine_service.request.client_stream import ClientStream
from engine_service.request.ledger import RequestLedger
from engine_service.request.probe_points import PROBE_POINT_PREFIX, check_client_point_names, probe_points
from engine_service.request.run import RequestRun, Stop, run_key
from engine_service.service.metrics import EngineMetrics
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

log = logging.getLogger(__name__)

# After a failed drain iteration, wait this long before the next one.
DRAIN_RETRY_S = 0.1
# The end of a request waits for its last acks at most the router timeout plus
# this, by which the link's watchdog has expired whatever is still in flight.
SETTLE_MARGIN_S = 1.0
# Pause between checks that vLLM's engine core still runs (a cheap flag read).
ENGINE_CHECK_INTERVAL_S = 1.0
# Pause between checks for requests held ahead of rows capture never delivered.
HELD_CHECK_INTERVAL_S = 0.5
# Pause between liveness checks of the workers (multi-node engines only: an RPC).
NODE_CHECK_INTERVAL_S = 5.0
# At shutdown, how long runs still settling get to send their finish.
CLOSE_FINISH_S = 5.0


@dataclass
class EngineSettings:
    default_failure_policy: int = types_pb.FAILURE_POLICY_FAIL_CLOSED
    # A request whose router stays unreachable this long is aborted
    # (fail_closed) or marked unprobed (fail_open); gated tokens wait at most this.
    router_timeout_s: float = 3.0
    # Pause between drains while no request is running.
    idle_drain_interval_s: float = 0.005
    # Streams, points, prompt bytes, message sizes and client queue bytes.
    limits: reqs.RequestLimits = field(default_factory=reqs.RequestLimits)
    # With workers on other nodes: how long every worker may take to answer the
    # liveness check before the engine counts a node as lost (None: no check).
    node_timeout_s: float | None = None


class EngineRuntime:
    def __init__(
        self,
        llm,
        capture: CaptureController,
        link_config: links.RouterLinkConfig | None = None,
        settings: EngineSettings | None = None,
        metrics: EngineMetrics | None = None,
        allowances: AllowancePublisher | None = None,
        guards: operator_guards.GuardsFile | operator_guards.GuardPolicy | None = None,
    ):
        self.llm = llm
        # The operator-set bindings of each caller (--guards-file, re-read as it
        # changes; or a fixed policy), or None.
        self.guards = guards
        # With --max-tokens-ahead: tells vLLM's scheduler how far each probed request may compute.
        self.allowances = allowances
        self.capture = capture
        # Capture's running totals already added to a metric, per metric (see _count_growth).
        self._totals_counted: dict[object, int] = {}
        self.link_config = link_config
        self.link: links.RouterLink | None = None
        self.settings = settings or EngineSettings()
        self.metrics = metrics or EngineMetrics()
        # Every running request, by run key: the one table the drain loop, the
        # router link's events and capture's reports are looked up in.
        self.runs: dict[str, RequestRun] = {}
        # The same runs by (caller, request id): what a client calls its request.
        self._by_client: dict[tuple[str, str], RequestRun] = {}
        self._producers: set[asyncio.Task] = set()
        self.accepting = True
        # Why the drain loop stopped (the engine then serves nothing), or None.
        self.drain_stopped: str | None = None
        # Why vLLM can serve nothing any more (its engine core stopped, a node was
        # lost), or None. Set once; the process then exits for a supervisor to restart it.
        self.engine_lost: str | None = None
        self._closing = False
        self._incarnations = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._abort_tasks: set[asyncio.Task] = set()
        # Resolved at the end of the next drain iteration that starts after they were added.
        self._drain_waiters: list[asyncio.Future] = []
        model_config = llm.vllm_config.model_config
        self.limits = reqs.ModelLimits(
            vocab_size=model_config.get_vocab_size(), max_model_len=model_config.max_model_len
        )
        self._tokenizer = llm.get_tokenizer()

    @property
    def active(self) -> dict[str, RequestRun]:
        """The running requests by run key."""
        return self.runs

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        model = await self.capture.start()
        if self.link_config is not None:
            self.link = links.RouterLink(
                self.link_config, model, self._on_link_event, registry=self.metrics.registry
            )
            await self.link.start()
        drain = asyncio.create_task(self._drain_loop(), name="capture-drain")
        drain.add_done_callback(self._on_drain_loop_done)
        self._tasks.append(drain)
        self._tasks.append(asyncio.create_task(self._watch_engine(), name="engine-watch"))
        if self.allowances is not None:
            self._tasks.append(asyncio.create_task(self._watch_held_requests(), name="held-watch"))

    async def _watch_engine(self) -> None:
        """Checks every ENGINE_CHECK_INTERVAL_S that vLLM's engine core runs and,
        on a multi-node engine, every NODE_CHECK_INTERVAL_S that every worker
        answers; the first failure sets engine_lost, which health reports (the
        process then exits).

        vLLM marks itself `errored` when its engine core process dies (killed,
        out of memory, a crashed step), and fails every running request; it never
        recovers. A step that meets a lost node's closed connection kills the
        core the same way, but a node that is merely silent leaves calls to it
        waiting for good: hence a bound of our own on the worker check."""
        node_timeout_s = self.settings.node_timeout_s
        loop = asyncio.get_running_loop()
        next_node_check = loop.time() + NODE_CHECK_INTERVAL_S
        while True:
            await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
            if getattr(self.llm, "errored", False):
                self.engine_lost = (
                    "a node may be lost: vLLM's engine core stopped after a worker failed" if node_timeout_s
                    else "vLLM's engine core stopped"
                )
            elif node_timeout_s and loop.time() >= next_node_check:
                try:
                    await asyncio.wait_for(self.capture.check_workers(node_timeout_s), node_timeout_s + 1)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the timeout, or vLLM's error for the call
                    detail = f" ({type(exc).__name__}: {exc})" if str(exc) else ""
                    self.engine_lost = (
                        f"a node may be lost: a worker did not answer within {node_timeout_s:g} s{detail}"
                    )
                next_node_check = loop.time() + NODE_CHECK_INTERVAL_S
            if self.engine_lost is not None:
                log.error("%s", self.engine_lost)
                return

    async def _watch_held_requests(self) -> None:
        """With --max-tokens-ahead, vLLM holds a request whose rows are not settled,
        and only its end declares rows capture never delivered lost: each run
        checks whether it waits for rows capture lost (RequestRun.held_on_lost_rows)."""
        limit = self.settings.router_timeout_s + SETTLE_MARGIN_S
        while True:
            await asyncio.sleep(HELD_CHECK_INTERVAL_S)
            now = time.monotonic()
            for run in list(self.runs.values()):
                if self._bounded_ahead(run) and not run.ended:
                    self._apply(run, run.held_on_lost_rows(now, limit))
                    self._allow_ahead(run)

    def routers_up(self) -> int:
        return len(self.link.replicas_up()) if self.link else 0

    def health(self, routers_optional: bool) -> tuple[bool, str]:
        """(serving, why not): every worker answers, the drain loop runs and, unless
        optional, a router is up."""
        if self.engine_lost is not None:
            return False, self.engine_lost
        if self.drain_stopped is not None:
            return False, f"the capture drain loop stopped: {self.drain_stopped}"
        if not routers_optional and self.routers_up() == 0:
            return False, "no router session"
        return True, ""

    async def shutdown(self, abort_running: bool, grace_s: float,
                       why: str = "the engine is shutting down") -> None:
        """Stops accepting; lets running requests finish (or aborts them, saying
        why) within grace_s; every client gets its finish."""
        self.accepting = False
        if abort_running:
            for run in list(self.runs.values()):
                self._apply(run, run.failed(why))
        deadline = time.monotonic() + grace_s
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for run in list(self.runs.values()):
            self._apply(run, run.failed("the engine shut down before it finished"))
        await self.close()

    async def close(self) -> None:
        """Stops the drain loop and the watches, lets every run still settling send
        its client a finish, then closes the router link."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._release_drain_waiters()
        for run in list(self.runs.values()):
            self._apply(run, run.failed("the engine shut down before it finished"))
        if self._producers:
            _, pending = await asyncio.wait(self._producers, timeout=CLOSE_FINISH_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self.link is not None:
            await self.link.close()

    def model_info(self) -> types_pb.ModelInfo:
        return self.capture.model_info()

    # -- client API --------------------------------------------------------

    async def abort(self, request_id: str, caller: str = "") -> bool:
        run = self._by_client.get((caller, request_id))
        if run is None:
            return False
        if run.end(types_pb.FINISH_REASON_CLIENT_ABORT, message="aborted by Engine.Abort"):
            await self.llm.abort(run.key)
        return True

    async def generate(self, message: engine_pb.GenerateRequest, caller: str = "",
                       cache_salt: str | None = None) -> AsyncIterator[engine_pb.GenerateResponse]:
        """One Generate stream. Request ids are the caller's own: another caller's
        request of the same id is another request. cache_salt: vLLM matches cached
        prefix blocks only between requests of the same salt
        (engine_service.request.callers gives each caller its own)."""
        accepted_at = time.monotonic()
        if self.engine_lost is not None:
            raise Unavailable(f"the engine cannot serve: {self.engine_lost}")
        if self.drain_stopped is not None:
            raise Unavailable(f"the engine cannot capture: {self.drain_stopped}")
        if not self.accepting:
            raise Unavailable("the engine is shutting down and accepts no new requests")
        request_id = reqs.request_id_of(message)
        limits = self.settings.limits
        reqs.check_request(message, len(self.runs), limits, self.limits)
        pins.check_names(message.probes)
        guarded = operator_guards.apply(self.guards.for_caller(caller) if self.guards is not None else (), message)
        message = guarded.request
        message_bytes = reqs.client_message_bytes(message, limits)
        ids = await reqs.prompt_ids_off_loop(message, self._tokenizer.encode, self.limits)
        reqs.check_capacity(len(self.runs), limits)  # others may have started meanwhile
        if (caller, request_id) in self._by_client:
            raise AlreadyExists(f"request_id: {request_id!r} is already running")
        choice = reqs.sampling_choice(message.sampling, len(ids), self.limits)
        incarnation = next(self._incarnations)
        key = run_key(request_id, incarnation)
        bindings, infos = self._pin(key, message.probes)
        client_points = parse_points(message.extraction_points, self.model_info().num_layers)
        check_client_point_names(client_points)
        probe_captures = probe_points(infos)
        points = client_points + probe_captures
        self.capture.validate(points, len(ids))
        if message.gate_tokens and not bindings:
            raise FailedPrecondition("gate_tokens: needs at least one probe binding to gate on")
        stream = ClientStream(limits.client_queue_bytes, message_bytes, self._count_client_drop)
        run = RequestRun(
            key, request_id, incarnation, len(ids), bindings, infos,
            gate_tokens=message.gate_tokens,
            operator_probes=guarded.operator_probes,
            stream=stream,
            decode=self._tokenizer.decode,
            ledger=(RequestLedger(len(ids), pins.for_ledger(bindings, infos), probe_captures)
                    if bindings else None),
            captures=bool(points),
            on_first_token=lambda: self.metrics.time_to_first_token.observe(time.monotonic() - accepted_at),
        )
        self.runs[key] = run
        self._by_client[(caller, request_id)] = run
        self.metrics.requests_started.inc()
        producer = asyncio.create_task(self._run(run, ids, choice, points, accepted_at, cache_salt, caller),
                                       name=f"generate-{key}")
        self._producers.add(producer)
        producer.add_done_callback(self._producers.discard)
        try:
            yield engine_pb.GenerateResponse(started=engine_pb.GenerateStarted(request_id=request_id, prompt_tokens=len(ids)))
            while True:
                event = await stream.get()
                yield event
                if event.HasField("finished"):
                    break
            await producer
        finally:
            if not producer.done():  # the client went away
                if run.end(types_pb.FINISH_REASON_CLIENT_ABORT, message="client cancelled the stream"):
                    await self.llm.abort(run.key)
                await asyncio.gather(producer, return_exceptions=True)
            self.runs.pop(key, None)
            self._by_client.pop((caller, request_id), None)

    # -- one request -------------------------------------------------------

    def _pin(self, key: str, bindings) -> tuple[Sequence[session_pb.SessionBinding], list[types_pb.ProbeInfo]]:
        """The client's bindings pinned to the probe versions of the replica the run
        will live on."""
        if not bindings:
            return (), []
        if self.link is None:
            raise FailedPrecondition(
                "probes: this engine runs without routers (--router not set); bind no probes"
            )
        policy = self.settings.default_failure_policy
        infos = self.link.pin(key, pins.wanted(bindings, policy))
        return pins.pinned(bindings, infos, policy), infos

    async def _run(self, run: RequestRun, ids, choice: reqs.SamplingChoice, points, accepted_at: float,
                   cache_salt: str | None = None, caller: str = "") -> None:
        """Registers capture, runs vLLM, settles the run's rows, and always gives
        the client its finish. `caller` goes to the routers for their verdict logs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(output_kind=RequestOutputKind.DELTA, **choice.as_kwargs())
        if self._bounded_ahead(run):
            params.extra_args = self.allowances.extra_args(run.key)
        require_prompt_computation(params, points, run.prompt_tokens)
        vllm_reason = None
        registered = False
        try:
            try:
                if points:
                    await self.capture.register(run.key, points, run.prompt_tokens)
                    registered = True
                if run.ledger is not None and self.link is not None:
                    self.link.start_request(run.key, run.incarnation, run.bindings, run.prompt_tokens, run.ledger,
                                            caller=caller)
                # Ended already (an Engine.Abort while capture registered it, say):
                # vLLM never sees it. Ended while vLLM was still adding it: that abort
                # found nothing in vLLM, so it is repeated once vLLM answers.
                outputs = (
                    self.llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt=cache_salt), params, run.key)
                    if not run.ended
                    else _no_outputs()
                )
                first = True
                async for output in outputs:
                    if first and run.ended:
                        self._spawn_abort(run)
                    first = False
                    completion = output.outputs[0]
                    if completion.token_ids:
                        self.metrics.tokens_generated.inc(len(completion.token_ids))
                        run.tokens(list(completion.token_ids), completion.text)
                        self._allow_ahead(run)
                    if output.finished:
                        vllm_reason = completion.finish_reason
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # vLLM refused or failed this request only
                log.exception("request %s failed", run.key)
                run.failed(f"engine error: {type(exc).__name__}: {exc}")
            try:
                if registered:
                    await self.capture.unregister(run.key)
                await self._settle(run, captured=registered)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("request %s: ending capture or settling failed", run.key)
                run.failed(f"engine error after generation: {type(exc).__name__}: {exc}")
            self._account(run, run.settle())
            self._finish(run, vllm_reason, accepted_at)
        finally:
            if self._bounded_ahead(run):
                self.allowances.forget(run.key)
            if self.link is not None:
                self.link.end_request(run.key, run.finish_reason or types_pb.FINISH_REASON_STOP)
            if registered and not run.finished_sent:
                # Cancelled mid-run: capture must not keep the request's buffers.
                await asyncio.shield(self.capture.unregister(run.key))
            if not run.finished_sent:  # cancelled (the engine is closing): the client still gets its finish
                run.failed("the engine shut down before it finished")
                run.settle()
                self._finish(run, None, accepted_at)

    async def _settle(self, run: RequestRun, captured: bool) -> None:
        """Waits until the run's last rows were drained and delivered, then (with
        probes) until its routers acknowledged or gave up on every row."""
        if captured:
            await self._next_drain()
        ledger = run.ledger
        if ledger is None or self.link is None:
            return
        waiting = (types_pb.FINISH_REASON_UNSPECIFIED, types_pb.FINISH_REASON_PROBE_ABORT)
        deadline = time.monotonic() + self.settings.router_timeout_s + SETTLE_MARGIN_S
        while ledger.in_flight() and run.finish_reason in waiting:
            run.changed.clear()
            try:
                await asyncio.wait_for(run.changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break

    def _finish(self, run: RequestRun, vllm_reason: str | None, accepted_at: float) -> None:
        """The client's finish, and the metrics of how the run ended; a finish that
        fails still reaches the client, with the counts that can be read."""
        try:
            run.finish(vllm_reason)
        except Exception as exc:
            log.exception("request %s: finishing failed", run.key)
            run.finish_after_error(f"engine error while finishing: {type(exc).__name__}: {exc}")
        reason = run.finish_reason_name()
        self.metrics.requests_finished.labels(reason).inc()
        self.metrics.request_duration.labels(reason).observe(time.monotonic() - accepted_at)
        if run.ledger is not None and run.ledger.capture_lost_rows:
            self.metrics.dropped_records.labels("capture_lost").inc(run.ledger.capture_lost_rows)

    async def _next_drain(self) -> None:
        """Waits until a drain iteration that started after this call has finished
        (returns at once if the drain loop stopped)."""
        if self.drain_stopped is not None or self._closing:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    # -- applying what runs decide -----------------------------------------

    def _apply(self, run: RequestRun, stop: Stop | None) -> None:
        """A run ended itself: counts why, and stops it in vLLM."""
        if stop is None:
            return
        self._account(run, stop)
        self._spawn_abort(run)

    def _account(self, run: RequestRun, stop: Stop | None) -> None:
        if stop is not None and stop.reason in (types_pb.FINISH_REASON_PROBE_ABORT, types_pb.FINISH_REASON_ROUTER_UNAVAILABLE):
            self.metrics.aborts.labels(run.finish_reason_name()).inc()

    def _spawn_abort(self, run: RequestRun) -> None:
        """vLLM's abort of a run, from a synchronous caller (the task is kept referenced)."""
        task = asyncio.create_task(self.llm.abort(run.key))
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    def _bounded_ahead(self, run: RequestRun) -> bool:
        return self.allowances is not None and run.ledger is not None

    def _allow_ahead(self, run: RequestRun) -> None:
        """Raises how far vLLM may compute the run (--max-tokens-ahead) to past
        its first unsettled position; an ended run gets nothing more, so it stays
        held until vLLM's abort lands."""
        if self._bounded_ahead(run) and not run.ended:
            self.allowances.allow(run.key, run.ledger.settled_below(), run.prompt_tokens)

    # -- the drain loop ----------------------------------------------------

    async def _drain_loop(self) -> None:
        """Drains capture buffers after every engine step, off vLLM's busy loop."""
        while True:
            delivered = await self._drain_once()
            if not self.runs:
                await asyncio.sleep(self.settings.idle_drain_interval_s)
            elif not delivered:
                await asyncio.sleep(0.001)

    async def _drain_once(self) -> bool:
        """One drain: what capture delivered goes to clients and routers, its
        reports to their runs, and the runs waiting for this drain are told.
        A failing drain is counted; runs whose rows it may have lost end ERROR,
        so nothing is lost silently. Returns whether rows were delivered."""
        waiters, self._drain_waiters = self._drain_waiters, []
        blocks: list[activations.Block] = []
        started = time.monotonic()
        try:
            blocks = await self.capture.drain()
            self._count_undelivered_rows()
            for (key, point), positions in self.capture.pop_dropped_rows().items():
                run = self.runs.get(key)
                if run is not None:
                    run.backlog_dropped(point, positions, probe_point=point.startswith(PROBE_POINT_PREFIX))
            for key, error in self.capture.pop_request_errors().items():
                run = self.runs.get(key)
                if run is not None:
                    self._apply(run, run.failed(error))
            if blocks:
                self._deliver(blocks)
                self.metrics.drain_duration.observe(time.monotonic() - started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.drain_failures.inc()
            log.exception("capture drain iteration failed; retrying")
            self._end_runs_after_drain_failure(blocks, exc)
            await asyncio.sleep(DRAIN_RETRY_S)
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        return bool(blocks)

    def _end_runs_after_drain_failure(self, blocks: list[activations.Block], exc: Exception) -> None:
        """Rows drained but not delivered are lost for the runs they belong to; a
        failed drain may have lost rows of any capturing run."""
        if blocks:
            concerned = {r for b in blocks for r in b.request_ids}
            what = "delivering its activations failed"
        else:
            concerned = {key for key, run in self.runs.items() if run.captures}
            what = "draining activations failed"
        for key in sorted(concerned):
            run = self.runs.get(key)
            if run is not None:
                self._apply(run, run.failed(f"engine error: {what}: {type(exc).__name__}: {exc}"))

    def _on_drain_loop_done(self, task: asyncio.Task) -> None:
        """The drain loop is the engine's only path for activations: if it ever
        stops outside close(), the engine stops serving and ends every run."""
        if self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        self.drain_stopped = f"{type(exc).__name__}: {exc}" if exc else "cancelled"
        self.metrics.drain_failures.inc()
        log.error("capture drain loop stopped (%s): ending every request", self.drain_stopped)
        self._release_drain_waiters()
        for run in list(self.runs.values()):
            self._apply(run, run.failed(f"engine error: the capture drain loop stopped: {self.drain_stopped}"))

    def _release_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _deliver(self, blocks: list[activations.Block]) -> None:
        """Client-requested records go back in-band; probe records go to routers."""
        probe_blocks, client_blocks = [], []
        for block in blocks:
            self.metrics.captured_rows.inc(block.num_rows)
            self.metrics.captured_bytes.inc(block.rows.nbytes)
            (probe_blocks if block.point.startswith(PROBE_POINT_PREFIX) else client_blocks).append(block)
        if probe_blocks and self.link is not None:
            self.link.send_step(probe_blocks)
        if client_blocks:
            self._stream_to_clients(client_blocks)

    def _stream_to_clients(self, blocks: list[activations.Block]) -> None:
        for key, parts in partition_by_owner(blocks, owner_of=lambda key: key).items():
            run = self.runs.get(key)
            if run is not None:
                run.activations(parts)

    def _count_undelivered_rows(self) -> None:
        """Rows capture did not deliver: those workers dropped past their backlog bound
        (their requests fail with an error), and recomputed duplicates of delivered
        rows (not a loss)."""
        self._count_growth(self.metrics.dropped_records.labels("capture_backlog"), self.capture.backlog_rows_dropped)
        self._count_growth(self.metrics.recomputed_rows, self.capture.recomputed_rows_discarded)

    def _count_growth(self, counter, total: int) -> None:
        """Adds to `counter` what capture's running `total` grew by since the last call."""
        grown = total - self._totals_counted.get(counter, 0)
        if grown > 0:
            counter.inc(grown)
            self._totals_counted[counter] = total

    def _count_client_drop(self, records: int) -> None:
        self.metrics.dropped_records.labels("client_queue").inc(records)

    # -- router events -----------------------------------------------------

    def _on_link_event(self, event: links.LinkEvent) -> None:
        """Hands the run the link's news about it. A run that cannot take it has
        lost track of its rows: it ends ERROR, showing nothing more."""
        run = self.runs.get(event.request_id)
        if run is None or run.incarnation != event.incarnation:
            return  # about an earlier run of this key
        try:
            stop = run.link_event(event)
        except Exception as exc:
            log.exception("request %s: handling %s failed", run.key, type(event).__name__)
            stop = run.failed(f"engine error handling {type(event).__name__}: {type(exc).__name__}: {exc}")
        self._apply(run, stop)
        self._allow_ahead(run)


async def _no_outputs():
    """vLLM's outputs for a request that ended before vLLM was asked to run it."""
    return
    yield
