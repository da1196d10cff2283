"""The OpenAI API over HTTP: FastAPI routes served by uvicorn on the engine
service's event loop.

Each call is checked before its body is read: `Authorization: Bearer` against
the engine's client tokens (the gRPC port's), 401 in OpenAI's error format
otherwise. Its body (bounded like a gRPC request) is parsed into vLLM's
request model, chat messages go through vLLM's chat-template renderer, and the
GenerateRequest runs through `generate_for`, as on the gRPC port. A client
that goes away, streaming or not, cancels its stream, which aborts the request
in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelCard, ModelList
from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect
from vllm.exceptions import VLLMClientError, VLLMValidationError

from common.errors import UndercurrentError
from common.security.auth import ANONYMOUS, bearer_token
from common.security.tokens import TokenSet, TokensUnusable
from engine_service.openai_api import requests as reqs
from engine_service.openai_api.results import (
    Collected,
    Shape,
    activations,
    finish_extension,
    finish_reason,
    scores,
    usage,
)
from engine_service.request.callers import Callers
from engine_service.service.servicer import generate_for
from undercurrent.v1 import engine_pb2 as engine_pb

log = logging.getLogger(__name__)

UNAUTHORIZED = {
    "missing_token": "authentication required: send 'Authorization: Bearer <token>'",
    "malformed_header": "authentication failed: the Authorization header must be one 'Bearer <token>'",
}
WRONG_TOKEN = "authentication failed: the token is not valid for this service"
# Events between a streamed request's Generate stream and its HTTP response.
PUMP_QUEUE = 8


def _error(err: reqs.OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class OpenAIFront:
    """The routes of one engine: its runtime, callers, tokens, model and renderer."""

    def __init__(self, runtime, callers: Callers, tokens: TokenSet | None, model_name: str, renderer,
                 max_body_bytes: int):
        self.runtime = runtime
        self.callers = callers
        self.tokens = tokens
        self.model_name = model_name
        self.renderer = renderer  # vLLM's OnlineRenderer: chat templates
        self.max_body_bytes = max_body_bytes
        self.app = FastAPI(title="Undercurrent OpenAI-compatible API", docs_url=None, redoc_url=None,
                           openapi_url=None)
        self.app.add_exception_handler(Exception, self._internal_error)
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    async def _internal_error(self, raw: Request, exc: Exception) -> JSONResponse:
        """An unexpected failure of a handler, answered in OpenAI's shape (and logged)."""
        log.exception("%s %s failed", raw.method, raw.url.path, exc_info=exc)
        return _error(reqs.OpenAIError(f"internal error: {type(exc).__name__}", None, 500, "internal_error"))

    # -- routes ------------------------------------------------------------------

    async def models(self, raw: Request) -> Response:
        try:
            self._caller(raw)
        except reqs.OpenAIError as err:
            return _error(err)
        card = ModelCard(id=self.model_name, owned_by="undercurrent", max_model_len=self.runtime.limits.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    async def completions(self, raw: Request) -> Response:
        return await self._serve(raw, chat=False)

    async def chat_completions(self, raw: Request) -> Response:
        return await self._serve(raw, chat=True)

    # -- one call ----------------------------------------------------------------

    async def _serve(self, raw: Request, chat: bool) -> Response:
        try:
            caller = self._caller(raw)
            body = await self._parse(raw, ChatCompletionRequest if chat else CompletionRequest)
            if body.model not in (None, self.model_name):
                raise reqs.OpenAIError(f"The model `{body.model}` does not exist.", "model", 404, "not_found_error")
            if chat:
                translated = reqs.generate_request(body, reqs.CHAT, body.max_completion_tokens or body.max_tokens)
                translated.request.token_ids.ids.extend(await self._chat_prompt(body))
            else:
                translated = reqs.generate_request(body, reqs.COMPLETION, body.max_tokens)
                prompt = reqs.completion_prompt(body.prompt)
                if "text" in prompt:
                    translated.request.text = prompt["text"]
                else:
                    translated.request.token_ids.CopyFrom(prompt["token_ids"])
            events = generate_for(self.runtime, self.callers, caller, translated.request)
            try:
                started = await anext(events)
            except UndercurrentError as err:
                raise reqs.from_engine(err) from None
        except reqs.OpenAIError as err:
            return _error(err)
        request_id = started.started.request_id
        shape = Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", self.model_name)
        if translated.stream:
            return StreamingResponse(self._stream(events, shape, request_id, translated.include_usage),
                                     media_type="text/event-stream")
        return await self._whole(raw, events, shape, request_id)

    def _caller(self, raw: Request) -> str:
        """The caller the bearer token names (ANONYMOUS without tokens), else 401."""
        if self.tokens is None:
            return ANONYMOUS
        token, reason = bearer_token([("authorization", v) for v in raw.headers.getlist("authorization")])
        if token is None:
            raise reqs.OpenAIError(UNAUTHORIZED[reason], None, 401, "authentication_error")
        try:
            caller = self.tokens.caller_of(token)
        except TokensUnusable:
            raise reqs.OpenAIError("this service cannot check tokens now (its token file is unusable)", None, 503,
                                   "service_unavailable") from None
        if caller is None:
            raise reqs.OpenAIError(WRONG_TOKEN, None, 401, "authentication_error")
        return caller

    async def _parse(self, raw: Request, model):
        """The body, at most max_body_bytes, as vLLM's request model; 400 naming the field."""
        size, chunks = 0, []
        async for chunk in raw.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise reqs.OpenAIError(f"the request body is over {self.max_body_bytes} bytes", None, 413)
            chunks.append(chunk)
        try:
            return model.model_validate_json(b"".join(chunks))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or None
            raise reqs.OpenAIError(f"{where}: {first['msg']}" if where else first["msg"], where) from None

    async def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The messages as prompt token ids, through the model's chat template."""
        try:
            rendered = await self.renderer.render_chat(body)
        except VLLMValidationError as err:  # a field vLLM checks while rendering
            param = err.parameter or "messages"
            raise reqs.OpenAIError(f"{param}: {err.args[0] if err.args else err}", param) from None
        except (ValueError, TypeError, VLLMClientError) as err:  # vLLM's template and message errors
            raise reqs.OpenAIError(f"messages: {err}", "messages") from None
        if isinstance(rendered, ErrorResponse):
            error = rendered.error
            raise reqs.OpenAIError(error.message, error.param, error.code, error.type)
        _, inputs = rendered
        return list(inputs[0]["prompt_token_ids"])

    async def _whole(self, raw: Request, events: AsyncIterator[engine_pb.GenerateResponse], shape: Shape,
                     request_id: str) -> Response:
        """The answer once the stream ended; a client that leaves first cancels it."""
        collected = Collected(request_id=request_id)

        async def collect() -> None:
            async for response in events:
                collected.add(response)

        work = asyncio.create_task(collect())
        gone = asyncio.create_task(listen_for_disconnect(raw))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)  # nobody reads it
        try:
            work.result()
            return JSONResponse(shape.response(collected).model_dump(exclude_none=True))
        except reqs.OpenAIError as err:
            return _error(err)

    async def _stream(self, events: AsyncIterator[engine_pb.GenerateResponse], shape: Shape, request_id: str,
                      include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a role chunk (chat), text chunks as tokens are
        released, score chunks, the finish, usage if asked, [DONE].

        The Generate stream runs in a task of its own: Starlette cancels this
        generator within an AnyIO cancel scope when the client leaves, which
        would cancel every await of the stream's cleanup too (vLLM's abort
        among them); the task is cancelled once and cleans up in full. A small
        queue between them keeps the stream's own byte budget the bound."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=PUMP_QUEUE)
        pump = asyncio.create_task(_pump(events, queue), name=f"openai-{request_id}")
        received = 0
        try:
            if shape.chat:
                yield _sse(shape.chunk(text="", role=True).model_dump_json(exclude_unset=True))
            while (response := await queue.get()) is not None:
                kind = response.WhichOneof("event")
                if kind == "tokens":
                    received += len(response.tokens.token_ids)
                    yield _sse(shape.chunk(text=response.tokens.text).model_dump_json(exclude_unset=True))
                elif kind == "probe_event":
                    chunk = shape.chunk(no_choice=True, extension={"scores": [scores(response.probe_event.scores)]})
                    yield _sse(chunk.model_dump_json(exclude_unset=True))
                elif kind == "activations":
                    batch = activations(response.activations)
                    yield _sse(shape.chunk(no_choice=True, extension={"activations": [batch]})
                               .model_dump_json(exclude_unset=True))
                elif kind == "finished":
                    finished = response.finished
                    try:
                        reason = finish_reason(finished)
                    except reqs.OpenAIError as err:
                        yield _sse(json.dumps(err.body()))
                        break
                    yield _sse(shape.chunk(finish=reason, extension=finish_extension(finished, request_id))
                               .model_dump_json(exclude_unset=True))
                    if include_usage:
                        yield _sse(shape.chunk(no_choice=True, usage_info=usage(finished, received))
                                   .model_dump_json(exclude_unset=True))
        finally:
            if not pump.done():
                pump.cancel()  # the client left: the Generate stream ends and aborts the request in vLLM
        yield "data: [DONE]\n\n"


async def _pump(events: AsyncIterator[engine_pb.GenerateResponse], queue: asyncio.Queue) -> None:
    """Moves a Generate stream's events into `queue`, then None."""
    try:
        async for response in events:
            await queue.put(response)
    except asyncio.CancelledError:
        raise
    except Exception:  # the stream ends without its finish; the client sees [DONE]
        log.exception("a streamed request failed")
    await queue.put(None)


class _Server(uvicorn.Server):
    """uvicorn inside the engine's event loop: the engine owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before vLLM starts so a busy port fails fast."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(front: OpenAIFront, sock: socket.socket, ssl_context=None) -> tuple[_Server, asyncio.Task]:
    """Starts serving on `sock` (TLS with ssl_context); returns the server and its task."""
    config = uvicorn.Config(front.app, log_level="warning", access_log=False, lifespan="off",
                            ssl_context_factory=(lambda config, default: ssl_context) if ssl_context else None)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="openai-http")
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # its start-up error
    return server, task
