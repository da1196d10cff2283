"""What every Undercurrent gRPC server has: explicit message-size limits,
keepalive, the front door (common.security.auth) and the error-mapping
interceptor, grpc.health.v1, and its security (TLS, reflection when enabled).

The limits of a port (`PortLimits`) bound what callers that have not proven
anything yet can make it hold:
- the receive limit is sized to what the port needs (the engine's client port
  takes a prompt, not a 64 MiB batch);
- HTTP/2 flow-control windows do not grow by BDP probing: a stream's window
  grows to a message's size only while its handler reads it, which only an
  admitted call does, so a refused or unread call buffers at most the initial
  64 KiB window per stream;
- concurrent streams per connection, concurrent RPCs per server, and
  concurrent Health.Watch streams are capped (RESOURCE_EXHAUSTED past them).
A router's health can also be served on a loopback port of its own, in
plaintext, so container health checks need no client certificate.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.errors import ErrorMappingInterceptor, ResourceExhausted
from common.security.auth import FrontDoor
from common.security.config import LOOPBACK, ServerSecurity
from undercurrent.v1 import admin_pb2, engine_pb2, router_session_pb2

log = logging.getLogger(__name__)

# Both sides set the same explicit limit; larger engine steps are split.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CONCURRENT_RPCS = 1024
DEFAULT_MAX_STREAMS_PER_CONNECTION = 512
DEFAULT_MAX_HEALTH_WATCHERS = 64

SERVICE_FULL_NAMES = {
    name: service.full_name
    for contract in (admin_pb2, engine_pb2, router_session_pb2)
    for name, service in contract.DESCRIPTOR.services_by_name.items()
}

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *KEEPALIVE,
    ]


@dataclass(frozen=True)
class PortLimits:
    """What one server port accepts; past a limit a call ends RESOURCE_EXHAUSTED."""

    max_send_bytes: int = MAX_MESSAGE_BYTES
    max_receive_bytes: int = MAX_MESSAGE_BYTES
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS  # every call in flight, refused ones too
    max_streams_per_connection: int = DEFAULT_MAX_STREAMS_PER_CONNECTION
    max_health_watchers: int = DEFAULT_MAX_HEALTH_WATCHERS  # open Health.Watch streams

    def server_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_send_bytes),
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            *KEEPALIVE,
            ("grpc.http2.bdp_probe", 0),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.so_reuseport", 0),
        ]


class PortInUse(RuntimeError):
    pass


class LimitedHealth(health.aio.HealthServicer):
    """grpc.health.v1 with a cap on open Watch streams: health needs no
    credentials, and each watcher holds a handler for as long as it likes."""

    def __init__(self, max_watchers: int):
        super().__init__()
        self.max_watchers = max_watchers
        self.watchers = 0

    async def Watch(self, request, context) -> None:
        if self.watchers >= self.max_watchers:
            raise ResourceExhausted(f"Health.Watch: {self.watchers} watchers already, the most this "
                                    "server serves; poll Health.Check instead")
        self.watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watchers -= 1


@dataclass
class ServerHandle:
    server: aio.Server
    health: LimitedHealth
    port: int
    services: list[str]
    health_server: aio.Server | None = None  # the loopback health port, when asked for
    health_port: int | None = None

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        await self.health.set("", status)
        for name in self.services:
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        await asyncio.gather(self.server.stop(grace),
                             *([self.health_server.stop(grace)] if self.health_server else []))


async def start_server(
    registrations: list[tuple[object, object, str]],
    host: str,
    port: int,
    limits: PortLimits = PortLimits(),
    security: ServerSecurity | None = None,
    metrics_registry=None,
    transport_options: list[tuple[str, int]] = (),
    health_port: int | None = None,
) -> ServerHandle:
    """registrations: (add_XServicer_to_server, servicer, full service name) triples.

    transport_options: more gRPC channel arguments, after the defaults (which they override).
    health_port: also serve grpc.health.v1 alone, in plaintext, on 127.0.0.1:health_port
    (0: any free port).

    Starts NOT_SERVING; the caller flips health when its dependencies are ready.
    security None: plaintext with reflection and no checks (in-process test servers);
    refusals are counted in metrics_registry.
    """
    security = security if security is not None else ServerSecurity.plaintext()
    server = aio.server(
        # The front door runs first: a refused call never reaches a handler.
        interceptors=[FrontDoor(security.access, metrics_registry), ErrorMappingInterceptor()],
        options=[*limits.server_options(), *transport_options],
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    names = []
    for add, servicer, full_name in registrations:
        add(servicer, server)
        names.append(full_name)
    health_servicer = LimitedHealth(limits.max_health_watchers)
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
    handle = ServerHandle(server, health_servicer, bound, names)
    if health_port is not None:
        handle.health_server, handle.health_port = await _health_only(health_servicer, health_port, limits)
    await server.start()
    await handle.set_serving(False)
    log.info("listening on %s:%d with %s (%s)%s", host, bound,
             "TLS" if security.tls else "PLAINTEXT", ", ".join(names),
             f"; health on {LOOPBACK}:{handle.health_port}" if health_port is not None else "")
    if security.warning:
        log.warning(security.warning)
    return handle


async def _health_only(servicer: LimitedHealth, port: int, limits: PortLimits) -> tuple[aio.Server, int]:
    """grpc.health.v1 alone on a loopback port: only processes of this host (of
    this container or pod) reach it, and it tells them nothing but the status."""
    small = PortLimits(max_receive_bytes=64 * 1024, max_concurrent_rpcs=limits.max_health_watchers + 16,
                       max_health_watchers=limits.max_health_watchers)
    server = aio.server(interceptors=[FrontDoor({}), ErrorMappingInterceptor()],
                        options=small.server_options(), maximum_concurrent_rpcs=small.max_concurrent_rpcs)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(f"{LOOPBACK}:{port}")
    except RuntimeError as err:
        raise PortInUse(f"cannot listen on {LOOPBACK}:{port} (--health-port): {err}") from None
    if bound == 0:
        raise PortInUse(f"cannot listen on {LOOPBACK}:{port} (--health-port): the port is in use")
    await server.start()
    return server, bound
