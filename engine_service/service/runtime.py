"""The engine: vLLM's AsyncLLM, activation capture and the router link joined.

One drain loop runs beside vLLM's busy loop: after every step it drains the
workers' capture buffers (one collective_rpc, which vLLM serves between
steps), streams client-requested records back in-band and hands probe records
to the router link, whose sends never wait on the network. Router verdicts
come back as link events and become AsyncLLM.abort calls, which vLLM's single
scheduler applies on every rank at the next step.

Each probed request's RequestLedger is the one account of its rows: gated
tokens are released up to its settled positions, a failure a fail_closed
binding cannot accept ends the request ROUTER_UNAVAILABLE at its first
unsettled position, and GenerateFinished's counts are read from it.
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
from common.enum_names import short_name
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    Unavailable,
)
from engine_service import link as links
from engine_service.request import validation as reqs
from engine_service.request.active import ActiveRequest, TokenGate
from engine_service.capture.driver.controller import CaptureController, require_prompt_computation
from engine_service.request.client_stream import ClientStream
from engine_service.service.metrics import EngineMetrics
from engine_service.link.batching import partition_by_owner
from engine_service.request.probe_points import PROBE_POINT_PREFIX, ExpectedRows, check_client_point_names, probe_points
from engine_service.request.ledger import Failure, RequestLedger
from engine_service.engine_core.tokens_ahead import AllowancePublisher, request_key
from undercurrent.v1 import undercurrent_pb2 as pb

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


@dataclass
class EngineSettings:
    default_failure_policy: int = pb.FAILURE_POLICY_FAIL_CLOSED
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
    ):
        self.llm = llm
        # With --max-tokens-ahead: tells vLLM's scheduler how far each probed request may compute.
        self.allowances = allowances
        self.capture = capture
        # Capture's running totals already added to a metric, per metric (see _count_growth).
        self._totals_counted: dict[object, int] = {}
        self.link_config = link_config
        self.link: links.RouterLink | None = None
        self.settings = settings or EngineSettings()
        self.metrics = metrics or EngineMetrics()
        self.active: dict[str, ActiveRequest] = {}
        self.accepting = True
        # Why the drain loop stopped (the engine then serves nothing), or None.
        self.drain_stopped: str | None = None
        # Why vLLM can serve nothing any more (its engine core stopped, a node was
        # lost), or None. Set once; the process then exits for a supervisor to restart it.
        self.engine_lost: str | None = None
        self._closing = False
        self._incarnations = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._verdict_tasks: set[asyncio.Task] = set()
        # Resolved at the end of the next drain iteration that starts after they were added.
        self._drain_waiters: list[asyncio.Future] = []
        model_config = llm.vllm_config.model_config
        self.limits = reqs.ModelLimits(
            vocab_size=model_config.get_vocab_size(), max_model_len=model_config.max_model_len
        )
        self._tokenizer = llm.get_tokenizer()

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
        and only its end declares rows capture never delivered lost: a request
        held on such rows would wait for good. One that neither generated nor
        settled anything for the router timeout plus a margin, with nothing in
        flight to a router (the link's watchdog ends those) but rows owed by
        capture (drained within a step when capture works), has lost them:
        they fail as at the end, under the request's failure policy."""
        while True:
            await asyncio.sleep(HELD_CHECK_INTERVAL_S)
            now = time.monotonic()
            for request in list(self.active.values()):
                if not self._bounded_ahead(request) or request.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    continue
                progress = (request.generated, request.ledger.settled_below())
                if progress != request.progress:
                    request.progress, request.progress_at = progress, now
                elif (now - request.progress_at > self.settings.router_timeout_s + SETTLE_MARGIN_S
                      and not request.ledger.in_flight() and request.ledger.owed_by_capture()):
                    failure = self._declare_capture_lost(request)
                    if failure is not None:
                        self._on_unscored(request, failure)
                        self._allow_ahead(request)

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
        why) within grace_s."""
        self.accepting = False
        if abort_running:
            for request in list(self.active.values()):
                await self._stop(request, pb.FINISH_REASON_ERROR, message=why)
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request in list(self.active.values()):
            await self._stop(request, pb.FINISH_REASON_ERROR, message="the engine shut down before it finished")
        await self.close()

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.link is not None:
            await self.link.close()

    def model_info(self) -> pb.ModelInfo:
        return self.capture.model_info()

    # -- client API --------------------------------------------------------

    async def abort(self, request_id: str) -> bool:
        request = self.active.get(request_id)
        if request is None:
            return False
        await self._stop(request, pb.FINISH_REASON_CLIENT_ABORT, message="aborted by Engine.Abort")
        return True

    async def generate(self, message: pb.GenerateRequest,
                       cache_salt: str | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """cache_salt: vLLM matches cached prefix blocks only between requests of
        the same salt (engine_service.request.callers gives each caller its own)."""
        accepted_at = time.monotonic()
        if self.engine_lost is not None:
            raise Unavailable(f"the engine cannot serve: {self.engine_lost}")
        if self.drain_stopped is not None:
            raise Unavailable(f"the engine cannot capture: {self.drain_stopped}")
        if not self.accepting:
            raise Unavailable("the engine is shutting down and accepts no new requests")
        request_id = reqs.request_id_of(message)
        limits = self.settings.limits
        reqs.check_request(message, len(self.active), limits, self.limits)
        message_bytes = reqs.client_message_bytes(message, limits)
        ids = await reqs.prompt_ids_off_loop(message, self._tokenizer.encode, self.limits)
        reqs.check_capacity(len(self.active), limits)  # others may have started meanwhile
        if request_id in self.active:
            raise AlreadyExists(f"request_id: {request_id!r} is already running")
        choice = reqs.sampling_choice(message.sampling, len(ids), self.limits)
        probes, probe_infos = self._bind_probes(message.probes)
        client_points = parse_points(message.extraction_points, self.model_info().num_layers)
        check_client_point_names(client_points)
        probe_captures = probe_points(probe_infos)
        points = client_points + probe_captures
        self.capture.validate(points, len(ids))
        if message.gate_tokens and not probes:
            raise FailedPrecondition("gate_tokens: needs at least one probe binding to gate on")
        request = ActiveRequest(
            request_id=request_id,
            incarnation=next(self._incarnations),
            prompt_len=len(ids),
            probes=probes,
            gate=TokenGate(len(ids)) if message.gate_tokens else None,
            events=ClientStream(limits.client_queue_bytes, message_bytes, self._count_client_drop),
            captures=bool(points),
            accepted_at=accepted_at,
            ledger=(
                RequestLedger(len(ids), {p.probe: p.failure_policy for p in probes},
                              ExpectedRows(probe_captures, len(ids)))
                if probes
                else None
            ),
        )
        self.active[request_id] = request
        self.metrics.requests_started.inc()
        producer = asyncio.create_task(
            self._run(request, ids, choice, points, cache_salt), name=f"generate-{request_id}"
        )
        try:
            yield pb.GenerateResponse(
                started=pb.GenerateStarted(request_id=request_id, prompt_tokens=len(ids))
            )
            while True:
                event = await request.events.get()
                yield event
                if event.HasField("finished"):
                    break
            await producer
        finally:
            if not producer.done():  # the client went away
                await self._stop(request, pb.FINISH_REASON_CLIENT_ABORT, message="client cancelled the stream")
                await asyncio.gather(producer, return_exceptions=True)
            self.active.pop(request_id, None)

    # -- one request -------------------------------------------------------

    def _bind_probes(self, bindings) -> tuple[Sequence[pb.ProbeBinding], list[pb.ProbeInfo]]:
        if not bindings:
            return (), []
        if self.link is None:
            raise FailedPrecondition(
                "probes: this engine runs without routers (--router not set); bind no probes"
            )
        return reqs.bind_probes(bindings, self.link.catalog(), self.settings.default_failure_policy)

    async def _run(self, request: ActiveRequest, ids, choice: reqs.SamplingChoice, points,
                   cache_salt: str | None = None) -> None:
        """Registers capture, runs vLLM, and always finishes the request's client stream."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(output_kind=RequestOutputKind.DELTA, **choice.as_kwargs())
        if self._bounded_ahead(request):
            params.extra_args = self.allowances.extra_args(request_key(request.request_id, request.incarnation))
        require_prompt_computation(params, points, request.prompt_len)
        vllm_reason = None
        registered = False
        try:
            try:
                if points:
                    await self.capture.register(request.request_id, points, request.prompt_len)
                    registered = True
                if request.ledger is not None and self.link is not None:
                    self.link.start_request(
                        request.request_id,
                        request.incarnation,
                        request.probes,
                        request.prompt_len,
                        request.ledger,
                    )
                # Ended already (an Engine.Abort while capture registered it, say):
                # vLLM never sees it. Ended while vLLM was still adding it: that abort
                # found nothing in vLLM, so it is repeated once vLLM answers.
                outputs = (
                    self.llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt=cache_salt), params,
                                      request.request_id)
                    if request.finish_reason == pb.FINISH_REASON_UNSPECIFIED
                    else _no_outputs()
                )
                first = True
                async for output in outputs:
                    if first and request.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        self._spawn(self.llm.abort(request.request_id))
                    first = False
                    completion = output.outputs[0]
                    if completion.token_ids:
                        self._emit_tokens(request, list(completion.token_ids), completion.text)
                    if output.finished:
                        vllm_reason = completion.finish_reason
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # vLLM refused or failed this request only
                log.exception("request %s failed", request.request_id)
                request.end(pb.FINISH_REASON_ERROR, message=f"engine error: {type(exc).__name__}: {exc}")
            try:
                if registered:
                    await self.capture.unregister(request.request_id)
                await self._settle(request, captured=registered)
            except Exception as exc:
                log.exception("request %s: ending capture or settling failed", request.request_id)
                request.end(
                    pb.FINISH_REASON_ERROR,
                    message=f"engine error after generation: {type(exc).__name__}: {exc}",
                )
            try:
                self._finish(request, vllm_reason)
            except Exception as exc:  # the client is still owed its `finished`
                log.exception("request %s: finishing failed", request.request_id)
                request.events.put_nowait(pb.GenerateResponse(finished=pb.GenerateFinished(
                    finish_reason=pb.FINISH_REASON_ERROR,
                    prompt_tokens=request.prompt_len,
                    generated_tokens=request.generated,
                    message=f"engine error while finishing: {type(exc).__name__}: {exc}",
                )))
        finally:
            if self._bounded_ahead(request):
                self.allowances.forget(request_key(request.request_id, request.incarnation))
            if self.link is not None:
                self.link.end_request(request.request_id, request.finish_reason or pb.FINISH_REASON_STOP)
            if registered and request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                # Cancelled mid-run: capture must not keep the request's buffers.
                await asyncio.shield(self.capture.unregister(request.request_id))

    async def _settle(self, request: ActiveRequest, captured: bool) -> None:
        """Waits until the request's last rows were drained and delivered, then
        (with probes) until its router acknowledged or gave up on every row,
        and applies the failure policy to what the ledger says."""
        if captured:
            await self._next_drain()
        ledger = request.ledger
        if ledger is None or self.link is None:
            return
        waiting = (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_PROBE_ABORT)
        deadline = time.monotonic() + self.settings.router_timeout_s + SETTLE_MARGIN_S
        while ledger.in_flight() and request.finish_reason in waiting:
            request.ledger_changed.clear()
            try:
                await asyncio.wait_for(request.ledger_changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        ledger.expire(float("inf"), "rows still unacknowledged when the request ended")
        if captured:
            self._declare_capture_lost(request)
        failure = ledger.fail_closed_failure()
        if failure is not None and self._end(
            request, pb.FINISH_REASON_ROUTER_UNAVAILABLE, *self._unscored_verdict(request, failure)
        ):
            self.metrics.aborts.labels("ROUTER_UNAVAILABLE").inc()

    def _declare_capture_lost(self, request: ActiveRequest) -> Failure | None:
        """Rows capture owes the request's computed positions and never delivered
        are lost: failed in the ledger and counted."""
        ledger = request.ledger
        counted = ledger.dropped_records
        failure = ledger.capture_lost(reported_dropped=request.backlog_dropped_records)
        if failure is not None:
            self.metrics.dropped_records.labels("capture_lost").inc(ledger.dropped_records - counted)
        return failure

    def _unscored_verdict(self, request: ActiveRequest, failure: Failure) -> tuple[pb.Verdict, str]:
        """The verdict of a fail_closed request whose rows went unscored: at the
        first unsettled position, so no token from there on is ever shown."""
        reason = f"{failure.reason} (fail_closed)"
        verdict = pb.Verdict(
            request_id=request.request_id,
            token_position=request.ledger.first_unsettled(),
            reason=reason,
        )
        return verdict, reason

    async def _next_drain(self) -> None:
        """Waits until a drain iteration that started after this call has finished
        (returns at once if the drain loop stopped)."""
        if self.drain_stopped is not None:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def _emit_tokens(self, request: ActiveRequest, token_ids: list[int], text: str) -> None:
        first = request.generated
        request.generated += len(token_ids)
        self.metrics.tokens_generated.inc(len(token_ids))
        if request.ledger is not None:
            # Token g was sampled from position prompt_len + g - 1: every position
            # before the newest token's was computed, and owes its probe rows.
            request.ledger.computed_below(request.prompt_len + request.generated - 1)
            self._allow_ahead(request)
        if request.gate is None:
            self._send_tokens(request, pb.TokenChunk(token_ids=token_ids, text=text, first_index=first))
            return
        request.gate.hold(first, token_ids)
        self._release_gated(request)

    def _release_gated(self, request: ActiveRequest, everything: bool = False) -> None:
        """Shows held tokens the ledger settled (all of them at a clean finish);
        a gate a verdict closed holds none at or after the verdict."""
        gate = request.gate
        if everything:
            first, released = gate.release_all()
        else:
            first, released = gate.releasable(request.ledger.releasable_through())
        if released:
            self._send_tokens(
                request,
                pb.TokenChunk(token_ids=released, text=self._tokenizer.decode(released), first_index=first),
            )

    def _send_tokens(self, request: ActiveRequest, chunk: pb.TokenChunk) -> None:
        if not request.tokens_sent:
            request.tokens_sent = True
            self.metrics.time_to_first_token.observe(time.monotonic() - request.accepted_at)
        request.events.put_nowait(pb.GenerateResponse(tokens=chunk))

    def _finish(self, request: ActiveRequest, vllm_reason: str | None) -> None:
        if request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            request.end(reqs.VLLM_FINISH_REASONS.get(vllm_reason, pb.FINISH_REASON_ERROR))
        ledger = request.ledger
        # Positions of tokens the client got: generated token g sits at prompt_len + g.
        received_below = request.prompt_len + request.generated
        unprobed = ledger.unprobed_tokens(below=received_below) if ledger else 0
        if ledger is not None:
            self._show_scores(request, below=received_below)
        dropped = (
            (ledger.dropped_records if ledger else 0)
            + request.events.dropped_records
            + request.backlog_dropped_records
        )
        if request.gate is not None:
            if request.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH):
                self._release_gated(request, everything=True)
            else:  # scored tokens before the trigger (or the first unscored row)
                self._release_gated(request)
        if ledger is not None and ledger.failures and not ledger.fail_closed_failure() and not request.message:
            request.message = f"{unprobed} tokens unprobed (fail_open): {ledger.failures[0].reason}"
        reason = short_name(pb.FinishReason, request.finish_reason)
        self.metrics.requests_finished.labels(reason).inc()
        self.metrics.request_duration.labels(reason).observe(time.monotonic() - request.accepted_at)
        request.events.put_nowait(
            pb.GenerateResponse(
                finished=pb.GenerateFinished(
                    finish_reason=request.finish_reason,
                    verdict=request.verdict,
                    prompt_tokens=request.prompt_len,
                    generated_tokens=request.generated,
                    unprobed_tokens=unprobed,
                    dropped_records=dropped,
                    message=request.message,
                )
            )
        )

    async def _stop(
        self, request: ActiveRequest, reason: int, verdict: pb.Verdict | None = None, message=""
    ) -> None:
        if self._end(request, reason, verdict, message):
            await self.llm.abort(request.request_id)

    def _stop_soon(
        self, request: ActiveRequest, reason: int, verdict: pb.Verdict | None = None, message=""
    ) -> None:
        """_stop from a synchronous callback. The request ends now, so the router
        replies handled right after this one (a verdict's ack comes in the same
        SessionReplies) never release a gated token at or after the verdict;
        only vLLM's abort runs as a task."""
        if self._end(request, reason, verdict, message):
            self._spawn(self.llm.abort(request.request_id))

    def _end(self, request: ActiveRequest, reason: int, verdict: pb.Verdict | None, message: str) -> bool:
        """Ends the request (False if it had ended) and closes its gate at the verdict."""
        if not request.end(reason, verdict, message):
            return False
        if request.gate is not None and verdict is not None:
            # Nothing at or after the trigger is ever shown; settled tokens before it may be.
            request.gate.close_at(verdict.token_position)
            self._release_gated(request)
        return True

    # -- the drain loop ----------------------------------------------------

    async def _drain_loop(self) -> None:
        """Drains capture buffers after every engine step, off vLLM's busy loop.

        A failing iteration is counted and retried; requests whose rows it may
        have lost end ERROR, so nothing is lost silently."""
        while True:
            waiters, self._drain_waiters = self._drain_waiters, []
            blocks: list[activations.Block] = []
            started = time.monotonic()
            try:
                blocks = await self.capture.drain()
                self._count_undelivered_rows()
                for request_id, rows in self.capture.pop_dropped_rows().items():
                    request = self.active.get(request_id)
                    if request is not None:
                        request.backlog_dropped_records += rows
                errors = self.capture.pop_request_errors()
                for request_id, error in errors.items():
                    request = self.active.get(request_id)
                    if request is not None:
                        await self._stop(request, pb.FINISH_REASON_ERROR, message=error)
                if blocks:
                    self._deliver(blocks)
                    self.metrics.drain_duration.observe(time.monotonic() - started)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.drain_failures.inc()
                log.exception("capture drain iteration failed; retrying")
                self._end_requests_after_drain_failure(blocks, exc)
                await asyncio.sleep(DRAIN_RETRY_S)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            if not self.active:
                await asyncio.sleep(self.settings.idle_drain_interval_s)
            elif not blocks:
                await asyncio.sleep(0.001)

    def _end_requests_after_drain_failure(self, blocks: list[activations.Block], exc: Exception) -> None:
        """Rows drained but not delivered are lost for the requests they belong
        to; a failed drain may have lost rows of any capturing request."""
        if blocks:
            concerned = {r for b in blocks for r in b.request_ids}
            what = "delivering its activations failed"
        else:
            concerned = {r.request_id for r in self.active.values() if r.captures}
            what = "draining activations failed"
        for request_id in sorted(concerned):
            request = self.active.get(request_id)
            if request is not None:
                message = f"engine error: {what}: {type(exc).__name__}: {exc}"
                self._stop_soon(request, pb.FINISH_REASON_ERROR, message=message)

    def _on_drain_loop_done(self, task: asyncio.Task) -> None:
        """The drain loop is the engine's only path for activations: if it ever
        stops outside close(), the engine stops serving and ends every request."""
        if self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        self.drain_stopped = f"{type(exc).__name__}: {exc}" if exc else "cancelled"
        self.metrics.drain_failures.inc()
        log.error("capture drain loop stopped (%s): ending every request", self.drain_stopped)
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        for request in list(self.active.values()):
            message = f"engine error: the capture drain loop stopped: {self.drain_stopped}"
            self._stop_soon(request, pb.FINISH_REASON_ERROR, message=message)

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
        by_request = partition_by_owner(blocks, owner_of=lambda request_id: request_id)
        for request_id, parts in by_request.items():
            request = self.active.get(request_id)
            if request is None:
                continue
            request.events.put_activations(parts)

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

    def _spawn(self, aborting) -> None:
        """Runs vLLM's abort from a synchronous callback, keeping the task referenced."""
        task = asyncio.create_task(aborting)
        self._verdict_tasks.add(task)
        task.add_done_callback(self._verdict_tasks.discard)

    def _on_link_event(self, event: links.LinkEvent) -> None:
        request = self.active.get(event.request_id)
        if request is None or request.incarnation != event.incarnation:
            return  # about an earlier run of this request id
        if isinstance(event, links.Scores):
            scores = pb.ProbeScores()
            scores.CopyFrom(event.scores)
            scores.router = event.replica
            scores.ClearField("incarnation")
            self._show(request, request.scores.add(scores, request.ledger))
        elif isinstance(event, links.Abort):
            self.metrics.aborts.labels("PROBE_ABORT").inc()
            verdict = pb.Verdict()
            verdict.CopyFrom(event.verdict)
            verdict.router = event.replica
            verdict.ClearField("incarnation")
            self._stop_soon(request, pb.FINISH_REASON_PROBE_ABORT, verdict=verdict)
        elif isinstance(event, links.Processed):
            request.ledger_changed.set()
            self._allow_ahead(request)
            self._show_scores(request)
            if request.gate is not None and request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                self._release_gated(request)
        elif isinstance(event, links.Unscored):
            request.ledger_changed.set()
            self._show_scores(request)
            self._on_unscored(request, event.failure)
            self._allow_ahead(request)
        elif isinstance(event, links.Unavailable):
            self._on_router_unavailable(request, event)

    def _bounded_ahead(self, request: ActiveRequest) -> bool:
        return self.allowances is not None and request.ledger is not None

    def _allow_ahead(self, request: ActiveRequest) -> None:
        """Raises how far vLLM may compute the request (--max-tokens-ahead) to
        past its first unsettled position; an ended request gets nothing more,
        so it stays held until vLLM's abort lands."""
        if self._bounded_ahead(request) and request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            self.allowances.allow(request_key(request.request_id, request.incarnation),
                                  request.ledger.settled_below(), request.prompt_len)

    def _show_scores(self, request: ActiveRequest, below: int | None = None) -> None:
        """After the ledger moved: sends the client the held scores whose rows it
        now counts as scored."""
        self._show(request, request.scores.release(request.ledger, below))

    @staticmethod
    def _show(request: ActiveRequest, shown: list[pb.ProbeScores]) -> None:
        for scores in shown:
            response = pb.GenerateResponse()
            response.probe_event.scores.CopyFrom(scores)  # one copy; nested constructors make two
            request.events.put_nowait(response)

    def _on_unscored(self, request: ActiveRequest, failure: Failure) -> None:
        if request.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            return
        if failure.fail_closed:
            self.metrics.aborts.labels("ROUTER_UNAVAILABLE").inc()
            verdict, reason = self._unscored_verdict(request, failure)
            self._stop_soon(request, pb.FINISH_REASON_ROUTER_UNAVAILABLE, verdict=verdict, message=reason)
            return
        self._say_unprobed(request, failure.reason)
        if request.gate is not None:
            self._release_gated(request)

    def _on_router_unavailable(self, request: ActiveRequest, event: links.Unavailable) -> None:
        waited = time.monotonic() - event.since
        reason = f"no router reachable for {waited:.1f} s"
        if request.fail_closed():
            self._on_unscored(request, request.ledger.outage(reason))
        else:
            self._say_unprobed(request, reason)

    @staticmethod
    def _say_unprobed(request: ActiveRequest, reason: str) -> None:
        """Logs the first time a fail_open request goes on unprobed; its finish
        counts every unprobed token, so later steps only log at debug level."""
        level = logging.DEBUG if request.said_unprobed else logging.WARNING
        request.said_unprobed = True
        log.log(level, "request %s continues with unprobed tokens (fail_open): %s", request.request_id, reason)


async def _no_outputs():
    """vLLM's outputs for a request that ended before vLLM was asked to run it."""
    return
    yield
