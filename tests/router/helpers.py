"""A real router on loopback, probe files and blocks for the tests, and their Session client."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np

from common.activations import Block
from common.probe_format.files import write_probe
from router_service.server import Router, RouterConfig
from tools import session_client
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

HIDDEN = 16
LAYERS = 4


def model_info(hidden: int = HIDDEN, layers: int = LAYERS, tensor_types=(types_pb.TENSOR_TYPE_RESIDUAL_STREAM, types_pb.TENSOR_TYPE_MLP_OUT)):
    return types_pb.ModelInfo(model="test-model", hidden_size=hidden, num_layers=layers, dtype="bfloat16",
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
    return session_client.channel(router if isinstance(router, int) else router.port)


def block(rows, request_ids, positions, generated=None, layer=1, tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM,
          dtype="float32", point="p") -> Block:
    rows = np.asarray(rows, dtype=np.float32)
    positions = np.asarray(positions, dtype=np.int64)
    generated = np.ones(len(positions), bool) if generated is None else np.asarray(generated, bool)
    return Block(point, tensor_type, layer, rows, list(request_ids), positions, generated, dtype)


class SessionClient(session_client.SessionClient):
    """A Session to a router of the tests (in-process or a port), opened for the
    tests' small model unless another is given."""

    def __init__(self, router: Router | int, engine_id: str = "engine-1",
                 open_channel: grpc.aio.Channel | None = None):
        super().__init__(router if isinstance(router, int) else router.port, engine_id, open_channel)

    async def open(self, model: types_pb.ModelInfo | None = None, accepts_replies: bool = False) -> session_pb.RouterHello:
        return await super().open(model or model_info(), accepts_replies)


def bound(registry, *probes, **fields) -> list[session_pb.SessionBinding]:
    """request_start bindings of these probes at the versions `registry` holds."""
    loaded = {p.name: p.digest for p in registry.probes()}
    return [session_pb.SessionBinding(probe=p, digest=loaded.get(p, ""), **fields) for p in probes]


def kinds(messages) -> list[str]:
    return [m.WhichOneof("message") for m in messages]


def errors(messages) -> list[session_pb.RequestError]:
    return [m.error for m in messages if m.WhichOneof("message") == "error"]
