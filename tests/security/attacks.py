"""What the attacks in this folder do to real service processes: floods of raw
calls over many connections, the memory they cost the target, the sockets it
listens on, and what it logged."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import grpc
import psutil

from tools.process_memory import MemorySampler

MIB = 1024 * 1024


def separate_connection_options() -> list[tuple[str, int]]:
    """Options that give a channel a connection of its own (gRPC shares one
    between channels of the same target otherwise), with no send limit."""
    return [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]


def channels(address: str, count: int, credentials: grpc.ChannelCredentials | None,
             options: list | None = None) -> list[grpc.aio.Channel]:
    options = [*separate_connection_options(), *(options or [])]
    if credentials is None:
        return [grpc.aio.insecure_channel(address, options=options) for _ in range(count)]
    return [grpc.aio.secure_channel(address, credentials, options=options) for _ in range(count)]


async def flood(channels: list[grpc.aio.Channel], method: str, payload: bytes, calls: int,
                metadata=(), streaming_response: bool = False, timeout: float = 120) -> list[str]:
    """`calls` calls of `method` carrying the serialized `payload`, all at once,
    spread over the channels; the status code name of each (OK when served)."""
    async def one(index: int) -> str:
        channel = channels[index % len(channels)]
        try:
            if streaming_response:
                async for _ in channel.unary_stream(method)(payload, metadata=metadata, timeout=timeout):
                    pass
            else:
                await channel.unary_unary(method)(payload, metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            return err.code().name
        return "OK"

    return await asyncio.gather(*(one(i) for i in range(calls)))


@dataclass
class MemoryCost:
    """The target process's resident memory before an attack and at its peak."""

    before: int
    peak: int

    @property
    def rise(self) -> int:
        return self.peak - self.before

    def __str__(self) -> str:
        return f"RSS {self.before / MIB:.0f} MiB before, {self.peak / MIB:.0f} MiB at the peak (+{self.rise / MIB:.1f})"


class MemoryWatch:
    """Samples one process's RSS every 20 ms while the block runs."""

    def __init__(self, pid: int):
        self.pid = pid
        self.sampler = MemorySampler(pid, interval=0.02)

    async def __aenter__(self) -> "MemoryWatch":
        self.sampler.__enter__()
        self.before = self.sampler.phase("before").first.rss_by_pid[self.pid]
        self.sampler.phase("attack")
        return self

    async def __aexit__(self, *exc) -> None:
        self.sampler.finish()
        self.sampler.__exit__(*exc)

    @property
    def cost(self) -> MemoryCost:
        return MemoryCost(self.before, self.sampler.phases[-1].peak_rss_by_pid[self.pid])


def listening_addresses(pid: int, port: int) -> set[str]:
    """The local addresses process `pid` listens on at `port` (IPv4-mapped IPv6
    addresses as IPv4: gRPC listens on a dual-stack socket)."""
    return {c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def outside_address() -> str:
    """This host's address on its default route: how another machine reaches it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
        return probe.getsockname()[0]


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False
