"""The front door: one server interceptor that decides who may call what, before
any request message is read.

Each protected service maps to an `Access`: a bearer token from a TokenSet
(EngineService: client tokens; ProbeAdminService: admin tokens), a client
certificate whose identity is on an allowlist (ProbeRouterService: the
engines; ProbeAdminService: operators, when configured), or both. A call that
fails either check ends before its handler runs: UNAUTHENTICATED for a missing
or wrong token, PERMISSION_DENIED for a certificate whose identity is not
allowed, UNAVAILABLE while the token file cannot be read (fail closed).
Services not in the map (grpc.health.v1, reflection when enabled) pass.

gRPC reads a unary request whole before it calls the handler, so the door
serves every method with a streaming request: the checks run on the call's
metadata and peer certificate, and only an accepted call's message is read,
within `read_timeout_s` (a caller that opens calls and never sends the
message holds no handler for long). A refused call's bytes are never read or
parsed.

An accepted call runs with the caller's name in `current_caller()` (the
token's name, else the certificate identity that matched), which the engine
uses to give each request an owner and quotas. Refusals are counted by
service and reason; logs name the peer and the reason, never the token, at
most one line per (service, reason) per interval.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from dataclasses import dataclass

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from common.log_limits import RateLimitedLog
from common.security.tokens import TokenSet, TokensUnusable

log = logging.getLogger(__name__)

# The name of the caller when no check applies (plaintext development mode
# without tokens, or an unprotected service): every such caller is the same one.
ANONYMOUS = "anonymous"
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("undercurrent_caller", default=ANONYMOUS)

# Refusal reasons, the metric's label values.
MISSING_TOKEN = "missing_token"
MALFORMED_HEADER = "malformed_header"
WRONG_TOKEN = "wrong_token"
TOKENS_UNUSABLE = "tokens_unusable"
NO_CERTIFICATE = "no_certificate"
IDENTITY_NOT_ALLOWED = "identity_not_allowed"

# How long an accepted unary call may take to deliver its request message.
READ_TIMEOUT_S = 20.0

_REFUSALS = {
    MISSING_TOKEN: (grpc.StatusCode.UNAUTHENTICATED,
                    "authentication required: send 'authorization: Bearer <token>' metadata"),
    MALFORMED_HEADER: (grpc.StatusCode.UNAUTHENTICATED,
                       "authentication failed: the authorization metadata must be one 'Bearer <token>'"),
    WRONG_TOKEN: (grpc.StatusCode.UNAUTHENTICATED, "authentication failed: the token is not valid for this service"),
    TOKENS_UNUSABLE: (grpc.StatusCode.UNAVAILABLE,
                      "this service cannot check tokens now (its token file is unusable); every call is refused "
                      "until it is fixed"),
    NO_CERTIFICATE: (grpc.StatusCode.UNAUTHENTICATED, "this service needs a client certificate"),
    IDENTITY_NOT_ALLOWED: (grpc.StatusCode.PERMISSION_DENIED,
                           "permission denied: the client certificate's identity may not call this service"),
}


def current_caller() -> str:
    """The authenticated caller of the RPC being handled (ANONYMOUS without checks)."""
    return _CALLER.get()


@dataclass(frozen=True)
class Access:
    """Who may call one service: a token from `tokens` and/or a client
    certificate naming one of `identities` (None: that check is off)."""

    tokens: TokenSet | None = None
    identities: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.tokens is None and self.identities is None:
            raise ValueError("Access: give tokens, identities or both")


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


def certificate_identities(auth_context: dict) -> list[str]:
    """The names a verified client certificate proves: its common name and its
    DNS and URI subject alternative names. A wildcard names no one caller."""
    names = [*auth_context.get("x509_common_name", ()), *auth_context.get("peer_dns", ()),
             *auth_context.get("peer_uri", ())]
    decoded = [n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in names]
    return list(dict.fromkeys(n for n in decoded if n and "*" not in n))


def _token_caller(access: Access, metadata) -> tuple[str | None, str | None]:
    """(caller, None) or (None, refusal reason) for the token part of access."""
    token, reason = bearer_token(metadata)
    if token is None:
        return None, reason
    try:
        caller = access.tokens.caller_of(token)
    except TokensUnusable:
        return None, TOKENS_UNUSABLE
    return (caller, None) if caller is not None else (None, WRONG_TOKEN)


def _identity_caller(access: Access, context) -> tuple[str | None, str | None]:
    names = certificate_identities(context.auth_context())
    if not names:
        return None, NO_CERTIFICATE
    allowed = [n for n in names if n in access.identities]
    return (allowed[0], None) if allowed else (None, IDENTITY_NOT_ALLOWED)


class FrontDoor(aio.ServerInterceptor):
    """Checks callers per service ({full service name: Access}) and serves every
    method with a streaming request (see the module docstring). Installed on
    every server, first, even without checks: the bounded read applies to all."""

    def __init__(self, access: dict[str, Access], registry: CollectorRegistry | None = None,
                 read_timeout_s: float = READ_TIMEOUT_S):
        self.access = dict(access)
        self.read_timeout_s = read_timeout_s
        self.refusals = Counter(
            "undercurrent_auth_refused", "Calls refused for authentication, by service and reason",
            ["service", "reason"], registry=registry if registry is not None else CollectorRegistry(),
        )
        self._log = RateLimitedLog(log)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        service = method.split("/")[1] if method.count("/") >= 2 else ""
        access = self.access.get(service)
        token_check = None
        if access is not None and access.tokens is not None:
            token_check = _token_caller(access, handler_call_details.invocation_metadata)

        async def admit(context) -> None:
            """Sets the caller, or ends the call refused."""
            if access is None:
                return
            caller, reason = token_check if token_check is not None else (None, None)
            if reason is None and access.identities is not None:
                identity, reason = _identity_caller(access, context)
                caller = caller or identity
            if reason is not None:
                self.refusals.labels(service, reason).inc()
                self._log.log((service, reason), logging.WARNING, "refused %s from %s: %s", method,
                              context.peer(), reason.replace("_", " "))
                await context.abort(*_REFUSALS[reason])
            _CALLER.set(caller)

        return _behind_the_door(handler, admit, self.read_timeout_s)


def _behind_the_door(handler, admit, read_timeout_s: float):
    """`handler` served with a streaming request: admit(context) first, then
    (for a unary request) its one message read within read_timeout_s."""
    unary_request = bool(handler.unary_unary or handler.unary_stream)

    async def request(requests, context):
        await admit(context)
        if not unary_request:
            return requests
        try:
            return await asyncio.wait_for(anext(requests), read_timeout_s)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request message did not arrive within {read_timeout_s:g} s")

    kinds = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary_response(requests, context):
            return await inner(await request(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(unary_response, **kinds)

    inner = handler.unary_stream or handler.stream_stream
    if inspect.isasyncgenfunction(inner):
        async def stream_response(requests, context):
            async for response in inner(await request(requests, context), context):
                yield response
    else:  # it writes with context.write (grpc_health's Watch)
        async def stream_response(requests, context):
            await inner(await request(requests, context), context)

    return grpc.stream_stream_rpc_method_handler(stream_response, **kinds)
