"""Where the routers are: "host:port[,host:port...]" or "dns:NAME:PORT", and
the resolver that turns a DNS name into replica addresses. The engine's link and
`probe_lifecycle deploy` (which runs in the router image) find replicas by this
one rule."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StaticTargets:
    """A fixed list of replica addresses ("host:port"), one replica each."""

    addresses: tuple[str, ...]


@dataclass(frozen=True)
class DnsTarget:
    """A name re-resolved periodically; every address it resolves to is one replica."""

    host: str
    port: int


def parse_targets(spec: str) -> StaticTargets | DnsTarget:
    """Parses "h1:p1,h2:p2" or "dns:NAME:PORT"; raises ValueError naming the bad part."""
    spec = spec.strip()
    if not spec:
        raise ValueError(
            "router targets: empty; expected host:port[,host:port...] or dns:NAME:PORT"
        )
    if spec.startswith("dns:"):
        host, port = split_host_port(spec[len("dns:") :].lstrip("/"))
        return DnsTarget(host, port)
    addresses = []
    for part in spec.split(","):
        host, port = split_host_port(part.strip())
        addresses.append(join_host_port(host, port))
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"router targets {spec!r}: an address is listed twice")
    return StaticTargets(tuple(addresses))


def split_host_port(text: str) -> tuple[str, int]:
    """ "host:port" or "[v6addr]:port" -> (host, port)."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"router target {text!r}: expected [ipv6]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"router target {text!r}: expected host:port (ipv6 as [addr]:port)")
    if not host:
        raise ValueError(f"router target {text!r}: missing host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"router target {text!r}: port {port_text!r} is not in 1..65535")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address host resolves to, as "addr:port" ("[v6]:port"), via the stdlib resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], port) for info in infos})
