"""Domain errors and the one place that maps them to gRPC status codes.

Services raise these from plain modules; the interceptor (for unary calls) and
`abort_with` (inside streaming handlers) turn them into statuses, as KServe's
server does. Messages name the field and the reason.
"""

from __future__ import annotations

import logging

import grpc
from grpc import aio

log = logging.getLogger(__name__)


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
    """The proto StatusCode value of a gRPC status-code name ("NOT_FOUND")."""
    from undercurrent.v1 import undercurrent_pb2 as pb

    return pb.StatusCode.Value(f"STATUS_CODE_{name}")


def status_code_name(value: int) -> str:
    """The gRPC status-code name ("NOT_FOUND") of a proto StatusCode value."""
    from undercurrent.v1 import undercurrent_pb2 as pb

    return pb.StatusCode.Name(value).removeprefix("STATUS_CODE_")


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, UndercurrentError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with(context: aio.ServicerContext, exc: BaseException) -> None:
    """Ends the call with exc's status; logs unexpected errors with a traceback."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unexpected error in handler", exc_info=exc)
    await context.abort(code, message)


class ErrorMappingInterceptor(aio.ServerInterceptor):
    """Maps domain errors raised by any handler to their gRPC status."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(behavior):
    async def wrapper(request, context):
        try:
            return await behavior(request, context)
        except UndercurrentError as exc:
            await abort_with(context, exc)

    return wrapper


def _wrap_stream(behavior):
    async def wrapper(request_or_iterator, context):
        try:
            async for response in behavior(request_or_iterator, context):
                yield response
        except UndercurrentError as exc:
            await abort_with(context, exc)

    return wrapper
