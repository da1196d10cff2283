"""The engine: vLLM's AsyncLLM, activation capture and the router link joined.

One drain loop runs beside vLLM's busy loop: after every step it drains the
workers' capture buffers (one collective_rpc), streams client-requested
records back in-band and hands probe records to the router link, whose sends
never wait on the network. Router verdicts come back as events and become
AsyncLLM.abort calls, which vLLM's single scheduler applies on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from common import activations
from common.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from engine_service import requests as reqs
from engine_service.active_request import ActiveRequest, BoundProbe, TokenGate
from undercurrent.v1 import undercurrent_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    default_failure_policy: int = pb.FAIL_CLOSED
    # A request whose router stays unreachable this long is aborted
    # (fail_closed) or marked unprobed (fail_open).
    router_timeout_s: float = 3.0
    # Pause between drains while no request is running.
    idle_drain_interval_s: float = 0.005
    # Client-stream activation messages queued per request before dropping.
    client_activation_queue: int = 256


class EngineRuntime:
    def __init__(self, llm, capture=None, link=None, settings: EngineSettings | None = None):
        self.llm = llm
        self.capture = capture
        self.link = link
        self.settings = settings or EngineSettings()
        self.active: dict[str, ActiveRequest] = {}
        self._tasks: list[asyncio.Task] = []
        model_config = llm.vllm_config.model_config
        self.limits = reqs.ModelLimits(
            vocab_size=model_config.get_vocab_size(), max_model_len=model_config.max_model_len
        )
        self._tokenizer = llm.get_tokenizer()
        self.accepting = True

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        if self.capture is not None:
            await self.capture.start()
            self._tasks.append(asyncio.create_task(self._drain_loop(), name="capture-drain"))

    async def shutdown(self, abort_running: bool, grace_s: float) -> None:
        """Stops accepting; lets running requests finish (or aborts them) within grace_s."""
        self.accepting = False
        if abort_running:
            for request in list(self.active.values()):
                await self._stop(request, pb.ERROR, message="the engine is shutting down")
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request in list(self.active.values()):
            await self._stop(request, pb.ERROR, message="the engine shut down before it finished")
        await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def model_info(self) -> pb.ModelInfo:
        if self.capture is not None:
            return self.capture.model_info()
        cfg = self.llm.vllm_config
        return pb.ModelInfo(
            model=cfg.model_config.model,
            architecture=(cfg.model_config.hf_config.architectures or [""])[0],
            num_layers=cfg.model_config.get_num_layers(cfg.parallel_config),
            hidden_size=cfg.model_config.get_hidden_size(),
            dtype=str(cfg.model_config.dtype).removeprefix("torch."),
            tensor_parallel_size=cfg.parallel_config.tensor_parallel_size,
            pipeline_parallel_size=cfg.parallel_config.pipeline_parallel_size,
            vocab_size=self.limits.vocab_size,
            max_model_len=self.limits.max_model_len,
        )

    # -- client API --------------------------------------------------------

    async def abort(self, request_id: str) -> bool:
        request = self.active.get(request_id)
        if request is None:
            return False
        await self._stop(request, pb.CLIENT_ABORT, message="aborted by Engine.Abort")
        return True

    async def generate(self, message: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        if not self.accepting:
            raise Unavailable("the engine is shutting down and accepts no new requests")
        request_id = reqs.request_id_of(message)
        if request_id in self.active:
            raise AlreadyExists(f"request_id: {request_id!r} is already running")
        ids = reqs.prompt_ids(message, self._tokenizer.encode, self.limits)
        choice = reqs.sampling_choice(message.sampling, len(ids), self.limits)
        request = ActiveRequest(
            request_id=request_id,
            prompt_len=len(ids),
            probes=self._bind_probes(message.probes),
            gate=TokenGate(len(ids)) if message.gate_tokens else None,
            events=asyncio.Queue(),
        )
        if request.gate is not None and not request.probes:
            raise FailedPrecondition("gate_tokens: needs at least one probe binding to gate on")
        self.active[request_id] = request
        producer = asyncio.create_task(self._run(request, ids, choice), name=f"gen-{request_id}")
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
                await self._stop(request, pb.CLIENT_ABORT, message="client cancelled the stream")
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
            self.active.pop(request_id, None)

    # -- internals ---------------------------------------------------------

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
                    f"probes[{i}].probe: {binding.probe!r} is not loaded in any router "
                    f"(loaded: {known})"
                )
            bound.append(
                BoundProbe(
                    name=binding.probe,
                    info=info,
                    failure_policy=binding.failure_policy or self.settings.default_failure_policy,
                    action=binding.action or info.action or pb.OBSERVE,
                )
            )
        return bound

    async def _run(self, request: ActiveRequest, ids: list[int], choice: reqs.SamplingChoice):
        """Feeds vLLM's outputs for one request into its client queue."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(output_kind=RequestOutputKind.DELTA, **choice.as_kwargs())
        vllm_reason = None
        try:
            async for output in self.llm.generate(
                TokensPrompt(prompt_token_ids=ids), params, request.request_id
            ):
                completion = output.outputs[0]
                if completion.token_ids:
                    self._emit_tokens(request, list(completion.token_ids), completion.text)
                if output.finished:
                    vllm_reason = completion.finish_reason
        except Exception as exc:  # vLLM refused or failed this request only
            log.exception("request %s failed in vLLM", request.request_id)
            request.end(pb.ERROR, message=f"engine error: {type(exc).__name__}: {exc}")
        self._finish(request, vllm_reason)

    def _emit_tokens(self, request: ActiveRequest, token_ids: list[int], text: str) -> None:
        first = request.generated
        request.generated += len(token_ids)
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
                        token_ids=released,
                        text=self._tokenizer.decode(released),
                        first_index=first,
                    )
                )
            )

    def _finish(self, request: ActiveRequest, vllm_reason: str | None) -> None:
        if request.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            request.end(reqs.VLLM_FINISH_REASONS.get(vllm_reason, pb.ERROR))
        if request.gate is not None:
            if request.finish_reason in (pb.STOP, pb.LENGTH):
                self._release_gated(request, everything=True)
        request.events.put_nowait(
            pb.GenerateResponse(
                finished=pb.GenerateFinished(
                    finish_reason=request.finish_reason,
                    verdict=request.verdict,
                    prompt_tokens=request.prompt_len,
                    generated_tokens=request.generated,
                    unprobed_tokens=request.unprobed_tokens,
                    dropped_records=request.dropped_client_records,
                    message=request.message,
                )
            )
        )

    async def _stop(
        self, request: ActiveRequest, reason: int, verdict: pb.Verdict | None = None, message=""
    ) -> None:
        if request.end(reason, verdict, message):
            await self.llm.abort(request.request_id)

    async def _drain_loop(self) -> None:
        """Drains capture buffers after every engine step, off vLLM's busy loop."""
        while True:
            if not self.active:
                await asyncio.sleep(self.settings.idle_drain_interval_s)
                continue
            try:
                blocks = await self.capture.drain()
            except Exception:
                log.exception("capture drain failed; retrying")
                await asyncio.sleep(0.1)
                continue
            if blocks:
                self._deliver(blocks)
            else:
                await asyncio.sleep(0)

    def _deliver(self, blocks: list[activations.Block]) -> None:
        raise NotImplementedError
