"""The one place the lifecycle commands open gRPC channels and find router replicas."""

from __future__ import annotations

import grpc

from common.grpc_server import channel_options
from common.security.client import channel_from_env
from engine_service.link.targets import DnsTarget, parse_targets, resolve_dns


def channel(address: str) -> grpc.aio.Channel:
    """TLS and tokens from UNDERCURRENT_TLS_* / UNDERCURRENT_*TOKEN (common.security.client)."""
    return channel_from_env(address, channel_options())


async def router_addresses(spec: str) -> list[str]:
    """Every replica of "host:port[,host:port...]" or "dns:NAME:PORT" (resolved now),
    parsed and resolved exactly as the engine finds its routers."""
    target = parse_targets(spec)
    if isinstance(target, DnsTarget):
        try:
            addresses = await resolve_dns(target.host, target.port)
        except OSError as err:
            raise ValueError(f"--routers {spec!r}: {target.host} does not resolve: {err}") from None
        if not addresses:
            raise ValueError(f"--routers {spec!r}: {target.host} resolves to no address")
        return addresses
    return list(target.addresses)
