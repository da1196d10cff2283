"""A loopback TCP proxy that can turn into a blackhole: network faults between
an engine and a router, made for real, without root or iptables.

The engine connects to the proxy's port; every connection is forwarded to the
current target. `blackhole()` keeps every connection open but forwards nothing
more in either direction (bytes read are discarded, as a network that silently
loses packets would), so neither side sees an error: only silence.
`retarget()` sends new connections elsewhere and closes the old ones.

Bounded: each direction moves at most CHUNK bytes at a time and waits for the
other side's transport to drain before reading again, so a slow peer slows the
sender (TCP backpressure) instead of growing a buffer here.
"""

from __future__ import annotations

import asyncio
import contextlib

CHUNK = 64 * 1024


class TcpProxy:
    def __init__(self, target: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.forwarding = True
        self.connections = 0  # accepted since start
        self.discarded_bytes = 0  # read while blackholed
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._pairs)

    async def start(self) -> "TcpProxy":
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def blackhole(self) -> None:
        """From now on nothing passes, in either direction; connections stay open."""
        self.forwarding = False

    def restore(self) -> None:
        self.forwarding = True

    def retarget(self, target: str) -> None:
        """New connections go to `target`; open ones are closed (the client reconnects)."""
        self.target = target
        self.drop_connections()

    def drop_connections(self) -> None:
        for client, upstream in list(self._pairs):
            _close(client)
            _close(upstream)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> "TcpProxy":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _accept(self, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._tasks.add(asyncio.current_task())  # close() waits for every handler
        host, port = self.target.rsplit(":", 1)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            self._tasks.discard(asyncio.current_task())
            _close(client_writer)  # nothing listens there: the client sees a refused session
            return
        pair = (client_writer, upstream_writer)
        self._pairs.add(pair)
        pumps = [
            asyncio.create_task(self._pump(client_reader, upstream_writer)),
            asyncio.create_task(self._pump(upstream_reader, client_writer)),
        ]
        self._tasks.update(pumps)
        try:
            # Either side ending ends the connection on both sides.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            self._tasks.discard(asyncio.current_task())
            self._pairs.discard(pair)
            _close(client_writer)
            _close(upstream_writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    return
                if not self.forwarding:
                    self.discarded_bytes += len(data)
                    continue
                writer.write(data)
                await writer.drain()


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()
