"""The one place the lifecycle commands open gRPC channels and find router replicas."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.grpc_server import channel_options
from common.security.client import channel_from_env
from common.router_targets import DnsTarget, parse_targets, resolve_dns


@dataclass(frozen=True)
class Replicas:
    """The router replicas a --routers value names. `server_name` is the DNS name
    they were resolved from: with TLS each replica's certificate must carry that
    name, not its address, as when the engine dials them."""

    addresses: list[str]
    server_name: str | None = None


def channel(address: str, server_name: str | None = None) -> grpc.aio.Channel:
    """TLS and tokens from UNDERCURRENT_TLS_* / UNDERCURRENT_*TOKEN (common.security.client)."""
    return channel_from_env(address, channel_options(), server_name=server_name)


async def router_replicas(spec: str) -> Replicas:
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
        return Replicas(addresses, server_name=target.host)
    return Replicas(list(target.addresses))
