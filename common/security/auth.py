"""One server interceptor that authenticates callers by bearer token.

Each protected service (EngineService: client tokens; ProbeAdminService: admin
tokens) maps to a TokenSet. A call to it without `authorization: Bearer TOKEN`
metadata, or with a token not in the set, ends with UNAUTHENTICATED before the
handler runs (its request is not even parsed); unary and streaming methods
alike. Services not in the map (grpc.health.v1, reflection when enabled,
ProbeRouterService, which mutual TLS guards) pass through.

An accepted call runs with the caller's name in `current_caller()`, which the
engine uses to give each request an owner. Refusals are counted by service and
reason; logs name the peer and the reason, never the token.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from common.security.tokens import TokenSet

log = logging.getLogger(__name__)

# The name of the caller when no token check applies (plaintext development
# mode without tokens, or an unprotected service): every such caller is the same one.
ANONYMOUS = "anonymous"
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("undercurrent_caller", default=ANONYMOUS)

# Refusal reasons, the metric's label values.
MISSING_TOKEN = "missing_token"
MALFORMED_HEADER = "malformed_header"
WRONG_TOKEN = "wrong_token"

LOG_INTERVAL_S = 10.0  # at most one refusal log line per (service, reason) per interval


def current_caller() -> str:
    """The authenticated caller of the RPC being handled (ANONYMOUS without tokens)."""
    return _CALLER.get()


def bearer_token(metadata) -> tuple[str | None, str | None]:
    """(token, None) or (None, refusal reason) from invocation metadata."""
    values = [value for key, value in (metadata or ()) if key == "authorization"]
    if not values:
        return None, MISSING_TOKEN
    if len(values) > 1 or not isinstance(values[0], str):
        return None, MALFORMED_HEADER
    scheme, _, token = values[0].partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None, MALFORMED_HEADER
    return token, None


@dataclass
class _RefusalLog:
    """Rate-limited refusal logging, so a flood of bad calls cannot flood the log."""

    last: dict = field(default_factory=dict)
    suppressed: dict = field(default_factory=dict)

    def refused(self, service: str, method: str, reason: str, peer: str) -> None:
        key = (service, reason)
        now = time.monotonic()
        if now - self.last.get(key, -LOG_INTERVAL_S) < LOG_INTERVAL_S:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return
        self.last[key] = now
        more = self.suppressed.pop(key, 0)
        log.warning("refused %s from %s: %s%s", method, peer, reason.replace("_", " "),
                    f" ({more} more refusals of this kind not logged)" if more else "")


class TokenAuthInterceptor(aio.ServerInterceptor):
    """Bearer-token authentication for the services in `required`
    ({full service name: TokenSet})."""

    def __init__(self, required: dict[str, TokenSet], registry: CollectorRegistry | None = None):
        self.required = dict(required)
        self.refusals = Counter(
            "undercurrent_auth_refused", "Calls refused for authentication, by service and reason",
            ["service", "reason"], registry=registry if registry is not None else CollectorRegistry(),
        )
        self._log = _RefusalLog()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        service = method.split("/")[1] if method.count("/") >= 2 else ""
        tokens = self.required.get(service)
        if handler is None or tokens is None:
            return handler
        token, reason = bearer_token(handler_call_details.invocation_metadata)
        caller = tokens.caller_of(token) if token is not None else None
        if caller is None:
            reason = reason or WRONG_TOKEN
            self.refusals.labels(service, reason).inc()
            return _refusing(handler, service, method, reason, self._log)
        return _as_caller(handler, caller)


def _same_kind(handler, behavior, request_deserializer=None):
    """A handler of the same RPC kind as `handler` with a new behavior."""
    deserializer = request_deserializer or handler.request_deserializer
    if handler.unary_unary:
        make = grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream:
        make = grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary:
        make = grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.stream_stream_rpc_method_handler
    return make(behavior, request_deserializer=deserializer,
                response_serializer=handler.response_serializer)


def _refusing(handler, service: str, method: str, reason: str, refusal_log: _RefusalLog):
    message = {
        MISSING_TOKEN: "authentication required: send 'authorization: Bearer <token>' metadata",
        MALFORMED_HEADER: "authentication failed: the authorization metadata must be one 'Bearer <token>'",
        WRONG_TOKEN: "authentication failed: the token is not valid for this service",
    }[reason]

    async def refuse(request_or_iterator, context):
        refusal_log.refused(service, method, reason, context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.unary_stream or handler.stream_stream:
        async def refuse_stream(request_or_iterator, context):
            await refuse(request_or_iterator, context)
            yield  # pragma: no cover  (abort raises)

        behavior = refuse_stream
    else:
        behavior = refuse
    # The request of a refused call is never parsed.
    return _same_kind(handler, behavior, request_deserializer=lambda _bytes: None)


def _as_caller(handler, caller: str):
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request_or_iterator, context):
            _CALLER.set(caller)
            return await inner(request_or_iterator, context)

        return _same_kind(handler, unary)
    inner = handler.unary_stream or handler.stream_stream

    async def stream(request_or_iterator, context):
        _CALLER.set(caller)
        async for response in inner(request_or_iterator, context):
            yield response

    return _same_kind(handler, stream)
