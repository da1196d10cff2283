"""The fault-injection proxy on real loopback sockets: forwards, blackholes
with connections kept open, restores, and retargets."""

from __future__ import annotations

import asyncio

import pytest

from tools.tcp_proxy import TcpProxy


@pytest.fixture
async def echo_port():
    async def echo(reader, writer):
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def test_blackhole_keeps_the_connection_and_passes_nothing(echo_port):
    async with TcpProxy(f"127.0.0.1:{echo_port}") as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"hi")
        assert await reader.read(10) == b"hi"
        proxy.blackhole()
        writer.write(b"lost")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(10), 0.3)
        assert proxy.open_connections == 1 and proxy.discarded_bytes == 4
        proxy.restore()
        writer.write(b"back")
        assert await reader.read(10) == b"back"
        writer.close()


async def test_retarget_closes_old_connections_and_refuses_without_a_listener(echo_port):
    async with TcpProxy(f"127.0.0.1:{echo_port}") as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"up")
        assert await reader.read(10) == b"up"  # forwarded: the connection is established
        proxy.retarget("127.0.0.1:1")
        assert await asyncio.wait_for(reader.read(10), 5) == b""
        second, _ = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(second.read(10), 5) == b""
        assert proxy.connections == 2 and proxy.open_connections == 0
