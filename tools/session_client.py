"""One engine's side of a ProbeRouter Session, driven message by message: for
tests of the router and for benchmarks of a real router process."""

from __future__ import annotations

import asyncio

import grpc

from common.activations import Block, to_batch
from common.grpc_server import channel_options
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import router_session_pb2_grpc as session_pb_grpc

TIMEOUT = 20.0  # only a failing test waits this long; shared cores can be very busy


def channel(port: int) -> grpc.aio.Channel:
    """A plaintext channel to a router on loopback."""
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())


class SessionClient:
    """One engine's side of a Session: send EngineMessages, read RouterMessages."""

    def __init__(self, port: int, engine_id: str = "engine-1",
                 open_channel: grpc.aio.Channel | None = None):
        self.channel = open_channel if open_channel is not None else channel(port)
        self.stub = session_pb_grpc.ProbeRouterServiceStub(self.channel)
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.engine_id = engine_id
        self.call = None
        self.step = 0
        self.probes: dict[str, types_pb.ProbeInfo] = {}  # the router's probes, as its hello and catalogs list them
        self.digests: dict[str, str] = {}  # their serving versions' digests

    async def _messages(self):
        while (message := await self.outgoing.get()) is not None:
            yield message

    async def open(self, model: types_pb.ModelInfo, accepts_replies: bool = False) -> session_pb.RouterHello:
        self.call = self.stub.Session(self._messages())
        self.send(hello=session_pb.SessionHello(engine_id=self.engine_id, model=model,
                                        accepts_replies=accepts_replies))
        first = await self.recv()
        assert first.WhichOneof("message") == "hello", first
        return first.hello

    def send(self, **message) -> None:
        self.outgoing.put_nowait(session_pb.SessionRequest(**message))

    def start(self, request_id: str, *probes, prompt_tokens: int = 4, actions=None, digests=None) -> None:
        """request_start binding `probes` at the versions the router listed (or `digests`)."""
        digests = {**self.digests, **(digests or {})}
        bindings = [session_pb.SessionBinding(probe=p, action=(actions or {}).get(p, 0), digest=digests.get(p, ""))
                    for p in probes]
        self.send(request_start=session_pb.RequestStart(request_id=request_id, bindings=bindings,
                                                prompt_tokens=prompt_tokens))

    def end(self, request_id: str) -> None:
        self.send(request_end=session_pb.RequestEnd(request_id=request_id, finish_reason=types_pb.FINISH_REASON_STOP))

    def batch(self, *blocks: Block) -> int:
        self.step += 1
        self.send(batch=to_batch(list(blocks), step=self.step))
        return self.step

    def raw_batch(self, batch: types_pb.ActivationBatch) -> int:
        self.step += 1
        batch.step = self.step
        self.send(batch=batch)
        return self.step

    async def recv(self, timeout: float = TIMEOUT) -> session_pb.SessionResponse:
        message = await asyncio.wait_for(self.call.read(), timeout)
        listed = (message.hello.probes if message.HasField("hello")
                  else message.catalog.probes if message.HasField("catalog") else None)
        if listed is not None:
            self.probes = {p.name: p for p in listed}
            self.digests = {p.name: p.digest for p in listed}
        return message

    async def until_ack(self, step: int, skip=("heartbeat", "catalog")) -> list[session_pb.SessionResponse]:
        """Every message up to and including the ack of `step`, minus the skipped kinds."""
        out = []
        while True:
            message = await self.recv()
            kind = message.WhichOneof("message")
            if kind not in skip:
                out.append(message)
            if kind == "ack" and message.ack.step == step:
                return out

    async def sync(self) -> list[session_pb.SessionResponse]:
        """Sends an empty batch and returns everything before its ack (excluded)."""
        return (await self.until_ack(self.batch()))[:-1]

    async def until(self, kind: str) -> session_pb.SessionResponse:
        while True:
            message = await self.recv()
            if message.WhichOneof("message") == kind:
                return message

    async def close(self) -> None:
        self.outgoing.put_nowait(None)
        self.call.cancel()
        await self.channel.close()
