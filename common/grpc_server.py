"""What every Undercurrent gRPC server has: explicit message-size limits,
keepalive, the error-mapping interceptor, grpc.health.v1, and its security
(TLS, the token interceptor, reflection when enabled: common.security)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.errors import ErrorMappingInterceptor
from common.security.auth import TokenAuthInterceptor
from common.security.config import ServerSecurity
from undercurrent.v1 import undercurrent_pb2 as pb

log = logging.getLogger(__name__)

# Both sides set the same explicit limit; larger engine steps are split.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

SERVICE_FULL_NAMES = {
    name: service.full_name for name, service in pb.DESCRIPTOR.services_by_name.items()
}

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class PortInUse(RuntimeError):
    pass


@dataclass
class ServerHandle:
    server: aio.Server
    health: health.aio.HealthServicer
    port: int
    services: list[str]

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        await self.health.set("", status)
        for name in self.services:
            await self.health.set(name, status)


async def start_server(
    registrations: list[tuple[object, object, str]],
    host: str,
    port: int,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    security: ServerSecurity | None = None,
    metrics_registry=None,
    transport_options: list[tuple[str, int]] = (),
) -> ServerHandle:
    """registrations: (add_XServicer_to_server, servicer, full service name) triples.

    transport_options: more gRPC channel arguments, after the defaults (which they override).

    Starts NOT_SERVING; the caller flips health when its dependencies are ready.
    security None: plaintext with reflection and no tokens (in-process test servers);
    authentication refusals are counted in metrics_registry.
    """
    security = security if security is not None else ServerSecurity.plaintext()
    # Authentication runs first, so a refused call never reaches a handler.
    interceptors = [TokenAuthInterceptor(security.tokens, metrics_registry)] if security.tokens else []
    server = aio.server(
        interceptors=[*interceptors, ErrorMappingInterceptor()],
        options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0), *transport_options],
    )
    names = []
    for add, servicer, full_name in registrations:
        add(servicer, server)
        names.append(full_name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if security.reflection:
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
    try:
        if security.tls is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", security.tls.credentials())
    except RuntimeError as err:
        raise PortInUse(f"cannot listen on {host}:{port}: {err}") from None
    if bound == 0:
        raise PortInUse(f"cannot listen on {host}:{port}: the port is in use or not allowed")
    await server.start()
    handle = ServerHandle(server, health_servicer, bound, names)
    await handle.set_serving(False)
    log.info("listening on %s:%d with %s (%s)", host, bound,
             "TLS" if security.tls else "PLAINTEXT", ", ".join(names))
    if security.warning:
        log.warning(security.warning)
    return handle
