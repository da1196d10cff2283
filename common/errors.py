"""Domain errors and the one place that maps them to gRPC status codes.

Services raise these from plain modules; the interceptor turns them (and any
unexpected exception, as INTERNAL) into statuses, as KServe's server does.
Messages name the field and the reason.
"""

from __future__ import annotations

import inspect
import logging

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError
from google.rpc import code_pb2
from grpc import aio

from common.log_limits import RateLimitedLog

log = logging.getLogger(__name__)
# A caller can make a handler fail at will; each kind of failure is logged with
# its traceback at most once per interval.
_internal_log = RateLimitedLog(log)


class UndercurrentError(Exception):
    """Base class: a problem with a precise gRPC status."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(UndercurrentError):
    """The caller sent something malformed or inconsistent (names the field)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(UndercurrentError):
    """A named thing (probe, request) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(UndercurrentError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(UndercurrentError):
    """The request is well formed but the system's state refuses it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(UndercurrentError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(UndercurrentError):
    """Not ready yet, draining, or a dependency is unreachable."""

    code = grpc.StatusCode.UNAVAILABLE


def status_code_value(name: str) -> int:
    """The google.rpc.Code value of a gRPC status-code name ("NOT_FOUND")."""
    return code_pb2.Code.Value(name)


def status_code_name(value: int) -> str:
    """The gRPC status-code name ("NOT_FOUND") of a google.rpc.Code value; a
    value this build does not know (from a newer peer) as its number."""
    return code_pb2.Code.Name(value) if value in code_pb2.Code.values() else str(value)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, UndercurrentError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with(context: aio.ServicerContext, exc: BaseException, method: str = "") -> None:
    """Ends the call with exc's status; logs unexpected errors with a traceback
    (rate-limited per method and exception type)."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        _internal_log.log((method, type(exc).__qualname__), logging.ERROR, "unexpected error in handler",
                          exc_info=exc)
    await context.abort(code, message)


class ErrorMappingInterceptor(aio.ServerInterceptor):
    """The one place where a handler's failure becomes a status.

    Requests are parsed here, inside the handler, rather than by grpc-python
    (which turns a failing request deserializer into UNKNOWN): bytes that are
    not the method's request message come back INVALID_ARGUMENT, for unary and
    streaming requests alike. Domain errors map to their status; anything else
    a handler raises is INTERNAL, logged with its traceback (rate-limited per
    method and exception type).
    A streaming handler may yield its responses or write them with
    `context.write` (grpc_health's Watch does); the wrapper keeps its style.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        parse = _Parser(handler_call_details.method, handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, parse),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, parse),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, parse, streaming=True),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, parse, streaming=True),
                response_serializer=handler.response_serializer,
            )
        return handler


class _Parser:
    """Parses one call's request bytes; remembers the first message that did not parse."""

    def __init__(self, method: str, deserializer):
        self.method = method
        self.deserializer = deserializer
        self.failure: InvalidArgument | None = None

    def __call__(self, data: bytes):
        if self.deserializer is None:
            return data
        try:
            return self.deserializer(data)
        except DecodeError as err:
            self.failure = InvalidArgument(
                f"{self.method}: the request is not a valid {_request_type(self.method)} message "
                f"({len(data)} bytes): {err}"
            )
            raise self.failure from None

    async def stream(self, raw_messages):
        async for data in raw_messages:
            yield self(data)


def _request_type(method: str) -> str:
    """"/pkg.Service/Method" -> the full name of its request message."""
    try:
        service, name = method.lstrip("/").rsplit("/", 1)
        return descriptor_pool.Default().FindServiceByName(service).methods_by_name[name].input_type.full_name
    except (KeyError, ValueError):
        return "request"


async def _fail(context: aio.ServicerContext, parse: _Parser, exc: BaseException) -> None:
    # A handler that met an unparsable message may fail in its own way (or end
    # quietly, below); the caller still learns the cause.
    await abort_with(context, parse.failure or exc, parse.method)


def _wrap_unary(behavior, parse: _Parser, streaming: bool = False):
    async def wrapper(request, context):
        try:
            request = parse.stream(request) if streaming else parse(request)
            response = await behavior(request, context)
        except aio.AbortError:
            raise
        except Exception as exc:
            await _fail(context, parse, exc)
        else:
            if parse.failure is not None:
                await abort_with(context, parse.failure)
            return response

    return wrapper


def _wrap_stream(behavior, parse: _Parser, streaming: bool = False):
    if not inspect.isasyncgenfunction(behavior):  # it writes with context.write
        return _wrap_unary(behavior, parse, streaming)

    async def wrapper(request, context):
        try:
            request = parse.stream(request) if streaming else parse(request)
            async for response in behavior(request, context):
                yield response
        except aio.AbortError:
            raise
        except Exception as exc:
            await _fail(context, parse, exc)
        else:
            if parse.failure is not None:
                await abort_with(context, parse.failure)

    return wrapper
