"""A real router on loopback and a real grpc.aio Session client for the tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np

from common.activations import Block, to_batch
from common.grpc_server import channel_options
from router_service.probe_files import write_probe
from router_service.server import Router, RouterConfig
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc

HIDDEN = 16
LAYERS = 4
TIMEOUT = 20.0  # only a failing test waits this long; shared cores can be very busy


def model_info(hidden: int = HIDDEN, layers: int = LAYERS, tensor_types=(pb.TENSOR_TYPE_RESIDUAL_STREAM, pb.TENSOR_TYPE_MLP_OUT)):
    return pb.ModelInfo(model="test-model", hidden_size=hidden, num_layers=layers, dtype="bfloat16",
                        tensor_types=list(tensor_types))


def manifest(name: str, kind: str = "logistic", **fields) -> dict:
    base = dict(name=name, version="1", kind=kind, tensor_type="residual_stream", layers=[1],
                hidden_size=HIDDEN, dtype="float32", threshold=0.5, action="abort")
    base.update(fields)
    return base


def linear_probe(directory: Path, name: str, weight: np.ndarray, bias: float = 0.0, **fields) -> Path:
    return write_probe(directory / name, manifest(name, **fields),
                       {"weight": weight, "bias": np.array([bias])})


async def start_router(probes_dir: Path | None, **config) -> Router:
    config.setdefault("heartbeat_interval", 30.0)
    config.setdefault("grace_period", 2.0)
    router = Router(RouterConfig(host="127.0.0.1", port=0, probes_dir=probes_dir, **config))
    await router.start()
    return router


def channel(router: Router | int) -> grpc.aio.Channel:
    """A channel to an in-process router, or to a port."""
    port = router if isinstance(router, int) else router.port
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())


def block(rows, request_ids, positions, generated=None, layer=1, tensor_type=pb.TENSOR_TYPE_RESIDUAL_STREAM,
          dtype="float32", point="p") -> Block:
    rows = np.asarray(rows, dtype=np.float32)
    positions = np.asarray(positions, dtype=np.int64)
    generated = np.ones(len(positions), bool) if generated is None else np.asarray(generated, bool)
    return Block(point, tensor_type, layer, rows, list(request_ids), positions, generated, dtype)


class SessionClient:
    """One engine's side of a Session: send EngineMessages, read RouterMessages."""

    def __init__(self, router: Router | int, engine_id: str = "engine-1",
                 open_channel: grpc.aio.Channel | None = None):
        self.channel = open_channel if open_channel is not None else channel(router)
        self.stub = undercurrent_pb2_grpc.ProbeRouterServiceStub(self.channel)
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.engine_id = engine_id
        self.call = None
        self.step = 0

    async def _messages(self):
        while (message := await self.outgoing.get()) is not None:
            yield message

    async def open(self, model: pb.ModelInfo | None = None, accepts_replies: bool = False) -> pb.RouterHello:
        self.call = self.stub.Session(self._messages())
        self.send(hello=pb.SessionHello(engine_id=self.engine_id, model=model or model_info(),
                                        accepts_replies=accepts_replies))
        first = await self.recv()
        assert first.WhichOneof("message") == "hello", first
        return first.hello

    def send(self, **message) -> None:
        self.outgoing.put_nowait(pb.SessionRequest(**message))

    def start(self, request_id: str, *probes, prompt_length: int = 4, actions=None) -> None:
        bindings = [pb.ProbeBinding(probe=p, action=(actions or {}).get(p, 0)) for p in probes]
        self.send(request_start=pb.RequestStart(request_id=request_id, probes=bindings,
                                                prompt_length=prompt_length))

    def end(self, request_id: str) -> None:
        self.send(request_end=pb.RequestEnd(request_id=request_id, finish_reason=pb.FINISH_REASON_STOP))

    def batch(self, *blocks: Block) -> int:
        self.step += 1
        self.send(batch=to_batch(list(blocks), step=self.step))
        return self.step

    def raw_batch(self, batch: pb.ActivationBatch) -> int:
        self.step += 1
        batch.step = self.step
        self.send(batch=batch)
        return self.step

    async def recv(self, timeout: float = TIMEOUT) -> pb.SessionResponse:
        return await asyncio.wait_for(self.call.read(), timeout)

    async def until_ack(self, step: int, skip=("heartbeat", "catalog")) -> list[pb.SessionResponse]:
        """Every message up to and including the ack of `step`, minus the skipped kinds."""
        out = []
        while True:
            message = await self.recv()
            kind = message.WhichOneof("message")
            if kind not in skip:
                out.append(message)
            if kind == "ack" and message.ack.step == step:
                return out

    async def sync(self) -> list[pb.SessionResponse]:
        """Sends an empty batch and returns everything before its ack (excluded)."""
        return (await self.until_ack(self.batch()))[:-1]

    async def until(self, kind: str) -> pb.SessionResponse:
        while True:
            message = await self.recv()
            if message.WhichOneof("message") == kind:
                return message

    async def close(self) -> None:
        self.outgoing.put_nowait(None)
        self.call.cancel()
        await self.channel.close()


def kinds(messages) -> list[str]:
    return [m.WhichOneof("message") for m in messages]


def errors(messages) -> list[pb.RequestError]:
    return [m.error for m in messages if m.WhichOneof("message") == "error"]
