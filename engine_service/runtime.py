"""The engine: vLLM's AsyncLLM, activation capture and the router link joined.

One drain loop runs beside vLLM's busy loop: after every step it drains the
workers' capture buffers (one collective_rpc, which vLLM serves between
steps), streams client-requested records back in-band and hands probe records
to the router link, whose sends never wait on the network. Router verdicts
come back as link events and become AsyncLLM.abort calls, which vLLM's single
scheduler applies on every rank at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from common import activations
from common.capture_spec import parse_points
from common.enum_names import short_name
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    Unavailable,
    status_code_name,
)
from engine_service import requests as reqs
from engine_service import router_link as links
from engine_service import routing
from engine_service.active_request import ActiveRequest, BoundProbe, TokenGate
from engine_service.capture.controller import CaptureController, require_prompt_computation
from engine_service.metrics import EngineMetrics
from engine_service.probe_points import PROBE_POINT_PREFIX, check_client_point_names, probe_points
from undercurrent.v1 import undercurrent_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    default_failure_policy: int = pb.FAILURE_POLICY_FAIL_CLOSED
    # A request whose router stays unreachable this long is aborted
    # (fail_closed) or marked unprobed (fail_open); gated tokens wait at most this.
    router_timeout_s: float = 3.0
    # Pause between drains while no request is running.
    idle_drain_interval_s: float = 0.005
    # Client-stream activation messages queued per request before dropping.
    client_activation_queue: int = 256


class EngineRuntime:
    def __init__(
        self,
        llm,
        capture: CaptureController,
        link_config: links.RouterLinkConfig | None = None,
        settings: EngineSettings | None = None,
        metrics: EngineMetrics | None = None,
    ):
        self.llm = llm
        self.capture = capture
        self.link_config = link_config
        self.link: links.RouterLink | None = None
        self.settings = settings or EngineSettings()
        self.metrics = metrics or EngineMetrics()
        self.active: dict[str, ActiveRequest] = {}
        self.accepting = True
        self._tasks: list[asyncio.Task] = []
        self._verdict_tasks: set[asyncio.Task] = set()
        self._drained = asyncio.Condition()
        self._drain_generation = 0
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
        self._tasks.append(asyncio.create_task(self._drain_loop(), name="capture-drain"))

    def routers_up(self) -> int:
        return len(self.link.replicas_up()) if self.link else 0

    async def shutdown(self, abort_running: bool, grace_s: float) -> None:
        """Stops accepting; lets running requests finish (or aborts them) within grace_s."""
        self.accepting = False
        if abort_running:
            for request in list(self.active.values()):
                await self._stop(request, pb.FINISH_REASON_ERROR, message="the engine is shutting down")
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request in list(self.active.values()):
            await self._stop(request, pb.FINISH_REASON_ERROR, message="the engine shut down before it finished")
        await self.close()

    async def close(self) -> None:
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

    async def generate(self, message: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        if not self.accepting:
            raise Unavailable("the engine is shutting down and accepts no new requests")
        request_id = reqs.request_id_of(message)
        if request_id in self.active:
            raise AlreadyExists(f"request_id: {request_id!r} is already running")
        ids = reqs.prompt_ids(message, self._tokenizer.encode, self.limits)
        choice = reqs.sampling_choice(message.sampling, len(ids), self.limits)
        probes = self._bind_probes(message.probes)
        client_points = parse_points(message.extraction_points, self.model_info().num_layers)
        check_client_point_names(client_points)
        points = client_points + probe_points([p.info for p in probes])
        self.capture.validate(points, len(ids))
        if message.gate_tokens and not probes:
            raise FailedPrecondition("gate_tokens: needs at least one probe binding to gate on")
        request = ActiveRequest(
            request_id=request_id,
            prompt_len=len(ids),
            probes=probes,
            gate=TokenGate(len(ids)) if message.gate_tokens else None,
            events=asyncio.Queue(),
        )
        self.active[request_id] = request
        self.metrics.requests_started.inc()
        producer = asyncio.create_task(
            self._run(request, ids, choice, points), name=f"generate-{request_id}"
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

    def _bind_probes(self, bindings) -> list[BoundProbe]:
        if not bindings:
            return []
        if self.link is None:
            raise FailedPrecondition(
                "probes: this engine runs without routers (--router not set); bind no probes"
            )
        catalog = self.link.catalog()
        bound = []
        for i, binding in enumerate(bindings):
            info = catalog.get(binding.probe)
            if info is None:
                known = ", ".join(sorted(catalog)) or "none"
                raise NotFound(
                    f"probes[{i}].probe: {binding.probe!r} is not loaded in any reachable "
                    f"router (loaded: {known})"
                )
            bound.append(
                BoundProbe(
                    name=binding.probe,
                    info=info,
                    failure_policy=binding.failure_policy or self.settings.default_failure_policy,
                    action=binding.action or info.action or pb.PROBE_ACTION_OBSERVE,
                )
            )
        return bound

    async def _run(self, request: ActiveRequest, ids, choice: reqs.SamplingChoice, points) -> None:
        """Registers capture, runs vLLM, and finishes the request's client stream."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(output_kind=RequestOutputKind.DELTA, **choice.as_kwargs())
        require_prompt_computation(params, points, request.prompt_len)
        vllm_reason = None
        registered = False
        try:
            if points:
                await self.capture.register(request.request_id, points, request.prompt_len)
                registered = True
            if request.probes and self.link is not None:
                self.link.start_request(
                    request.request_id,
                    [
                        pb.ProbeBinding(probe=p.name, failure_policy=p.failure_policy, action=p.action)
                        for p in request.probes
                    ],
                    request.prompt_len,
                )
            async for output in self.llm.generate(
                TokensPrompt(prompt_token_ids=ids), params, request.request_id
            ):
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
        finally:
            if registered:
                await self.capture.unregister(request.request_id)
        try:
            await self._settle(request)
        except Exception as exc:
            log.exception("request %s: settling with its router failed", request.request_id)
            request.end(pb.FINISH_REASON_ERROR, message=f"engine error after generation: {exc}")
        self._finish(request, vllm_reason)

    async def _settle(self, request: ActiveRequest) -> None:
        """Sends the request's last rows to its router and waits (at most
        router_timeout_s) for their scores and verdicts before the stream ends."""
        if not request.probes or self.link is None:
            return
        await self._wait_for_drain()
        if request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            deadline = time.monotonic() + self.settings.router_timeout_s
            while (
                self.link.processed_position(request.request_id) < request.sent_position
                and request.finish_reason == pb.FINISH_REASON_UNSPECIFIED
                and self.link.unavailable_since(request.request_id) is None
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.005)
        processed = self.link.processed_position(request.request_id)
        router_lost = self.link.unavailable_since(request.request_id) is not None
        stats = self.link.end_request(request.request_id, request.finish_reason or pb.FINISH_REASON_STOP)
        # Positions sent but never acknowledged went unprobed as surely as those
        # that found no router at all (which the link counts; the two overlap).
        # A scored position was processed even if its ack was lost with the router.
        processed = max(processed, request.scored_position)
        unacknowledged = max(0, request.sent_position - max(processed, request.prompt_len - 1))
        request.unprobed_tokens += max(stats.unprobed_tokens, unacknowledged)
        request.dropped_router_records = stats.dropped_records
        if request.fail_closed() and (router_lost or request.unprobed_tokens):
            # fail_closed never reports a clean finish for tokens no probe saw.
            reason = (
                f"{request.unprobed_tokens} tokens were never probed: the router was "
                f"unreachable (fail_closed)"
            )
            request.end(
                pb.FINISH_REASON_ROUTER_UNAVAILABLE,
                pb.Verdict(request_id=request.request_id, reason=reason,
                           token_position=request.prompt_len + request.generated),
                reason,
            )

    async def _wait_for_drain(self) -> None:
        """Waits until a drain that started after this call has finished."""
        async with self._drained:
            target = self._drain_generation + 2
            await asyncio.wait_for(
                self._drained.wait_for(lambda: self._drain_generation >= target), timeout=30
            )

    def _emit_tokens(self, request: ActiveRequest, token_ids: list[int], text: str) -> None:
        first = request.generated
        request.generated += len(token_ids)
        self.metrics.tokens_generated.inc(len(token_ids))
        if request.gate is None:
            request.events.put_nowait(
                pb.GenerateResponse(
                    tokens=pb.TokenChunk(token_ids=token_ids, text=text, first_index=first)
                )
            )
            return
        request.gate.hold(token_ids)
        self._release_gated(request)

    def _release_gated(self, request: ActiveRequest, everything: bool = False) -> None:
        gate = request.gate
        first, released = gate.release_all() if everything else gate.releasable()
        if released:
            request.events.put_nowait(
                pb.GenerateResponse(
                    tokens=pb.TokenChunk(
                        token_ids=released, text=self._tokenizer.decode(released), first_index=first
                    )
                )
            )

    def _finish(self, request: ActiveRequest, vllm_reason: str | None) -> None:
        if request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            request.end(reqs.VLLM_FINISH_REASONS.get(vllm_reason, pb.FINISH_REASON_ERROR))
        if request.gate is not None and request.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH):
            self._release_gated(request, everything=True)
        self.metrics.requests_finished.labels(short_name(pb.FinishReason, request.finish_reason)).inc()
        request.events.put_nowait(
            pb.GenerateResponse(
                finished=pb.GenerateFinished(
                    finish_reason=request.finish_reason,
                    verdict=request.verdict,
                    prompt_tokens=request.prompt_len,
                    generated_tokens=request.generated,
                    unprobed_tokens=request.unprobed_tokens,
                    dropped_records=request.dropped_router_records + request.dropped_client_records,
                    message=request.message,
                )
            )
        )

    async def _stop(
        self, request: ActiveRequest, reason: int, verdict: pb.Verdict | None = None, message=""
    ) -> None:
        if request.end(reason, verdict, message):
            if request.gate is not None and verdict is not None:
                # Everything before the trigger was scored; nothing at or after it is shown.
                request.gate.acknowledge(verdict.token_position - 1)
                self._release_gated(request)
                request.gate.discard_from(verdict.token_position)
            await self.llm.abort(request.request_id)

    # -- the drain loop ----------------------------------------------------

    async def _drain_loop(self) -> None:
        """Drains capture buffers after every engine step, off vLLM's busy loop."""
        while True:
            try:
                blocks = await self.capture.drain()
                errors = self.capture.pop_request_errors()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("capture drain failed; retrying")
                await asyncio.sleep(0.1)
                continue
            for request_id, error in errors.items():
                request = self.active.get(request_id)
                if request is not None:
                    await self._stop(request, pb.FINISH_REASON_ERROR, message=error)
            if blocks:
                self._deliver(blocks)
            async with self._drained:
                self._drain_generation += 1
                self._drained.notify_all()
            if not self.active:
                await asyncio.sleep(self.settings.idle_drain_interval_s)
            elif not blocks:
                await asyncio.sleep(0.001)

    def _deliver(self, blocks: list[activations.Block]) -> None:
        """Client-requested records go back in-band; probe records go to routers."""
        probe_blocks, client_blocks = [], []
        for block in blocks:
            self.metrics.captured_rows.inc(block.num_rows)
            self.metrics.captured_bytes.inc(block.rows.nbytes)
            (probe_blocks if block.point.startswith(PROBE_POINT_PREFIX) else client_blocks).append(block)
        if probe_blocks and self.link is not None:
            for request_id, position in routing.max_positions(probe_blocks).items():
                request = self.active.get(request_id)
                if request is not None:
                    request.sent_position = max(request.sent_position, position)
            self.link.send_step(probe_blocks)
        if client_blocks:
            self._stream_to_clients(client_blocks)

    def _stream_to_clients(self, blocks: list[activations.Block]) -> None:
        by_request = routing.partition_by_owner(blocks, owner_of=lambda request_id: request_id)
        for request_id, parts in by_request.items():
            request = self.active.get(request_id)
            if request is None:
                continue
            if request.events.qsize() >= self.settings.client_activation_queue:
                request.dropped_client_records += sum(p.num_rows for p in parts)
                self.metrics.dropped_records.labels("client_queue").inc(sum(p.num_rows for p in parts))
                continue
            request.events.put_nowait(pb.GenerateResponse(activations=activations.to_batch(parts)))

    # -- router events -----------------------------------------------------

    def _spawn(self, stopping) -> None:
        """Runs an abort from a synchronous link callback, keeping the task referenced."""
        task = asyncio.create_task(stopping)
        self._verdict_tasks.add(task)
        task.add_done_callback(self._verdict_tasks.discard)

    def _on_link_event(self, event: links.LinkEvent) -> None:
        request = self.active.get(event.request_id)
        if request is None:
            return
        if isinstance(event, links.Scores):
            scores = pb.ProbeScores()
            scores.CopyFrom(event.scores)
            scores.router = event.replica
            if scores.token_positions:
                request.scored_position = max(request.scored_position, max(scores.token_positions))
            request.events.put_nowait(pb.GenerateResponse(probe_event=pb.ProbeEvent(scores=scores)))
        elif isinstance(event, links.Abort):
            self.metrics.aborts.labels("PROBE_ABORT").inc()
            verdict = pb.Verdict()
            verdict.CopyFrom(event.verdict)
            verdict.router = event.replica
            self._spawn(self._stop(request, pb.FINISH_REASON_PROBE_ABORT, verdict=verdict))
        elif isinstance(event, links.Processed):
            if request.gate is not None:
                request.gate.acknowledge(event.token_position)
                if request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                    self._release_gated(request)
        elif isinstance(event, links.Unavailable):
            self._on_router_unavailable(request, event)
        elif isinstance(event, links.StateReset):
            request.state_resets += 1
            log.warning("request %s re-homed to %s: %s", event.request_id, event.new_replica, event.reason)
        elif isinstance(event, links.RequestFailed):
            self._on_router_error(request, event.error)

    def _on_router_unavailable(self, request: ActiveRequest, event: links.Unavailable) -> None:
        waited = time.monotonic() - event.since
        if request.fail_closed():
            self.metrics.aborts.labels("ROUTER_UNAVAILABLE").inc()
            verdict = pb.Verdict(
                request_id=request.request_id,
                token_position=request.prompt_len + request.generated,
                reason=f"no router reachable for {waited:.1f} s (fail_closed)",
            )
            self._spawn(
                self._stop(request, pb.FINISH_REASON_ROUTER_UNAVAILABLE, verdict=verdict, message=verdict.reason)
            )
        else:
            log.warning("request %s continues unprobed (fail_open): no router for %.1f s",
                        request.request_id, waited)

    def _on_router_error(self, request: ActiveRequest, error: pb.RequestError) -> None:
        code = status_code_name(error.code)
        text = f"router error for probe {error.probe or '-'}: {code}: {error.message}"
        log.warning("request %s: %s", request.request_id, text)
        if request.fail_closed() and code in ("NOT_FOUND", "FAILED_PRECONDITION"):
            self._spawn(self._stop(request, pb.FINISH_REASON_ERROR, message=text))
        else:
            request.message = "; ".join(filter(None, [request.message, text]))
