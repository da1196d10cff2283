"""Real router processes with a verdict log, driven over loopback gRPC by a
Session client standing in for the engine (it pins versions with the engine's
own code), and the probes of the rollout tests.

Every probe reads layer 1 of the residual stream of a 16-wide model and is a
logistic probe on the row's first element: score = sigmoid(x0). Versions
differ only in threshold (and version string), so a test knows from the rows it
sends which versions fire where.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.probe_format.files import encode_safetensors
from engine_service.link.assignment import Wanted, pin_versions
from tests.router.helpers import HIDDEN, block, manifest, model_info
from tools import processes, stack
from tools.session_client import SessionClient
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

PROBE = "watch"
WEIGHT = np.eye(HIDDEN, dtype=np.float32)[0]


def sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-np.float64(np.float32(x)))))


def version_manifest(version: str, threshold: float, action: str = "abort") -> dict:
    return manifest(PROBE, version=version, threshold=threshold, action=action)


def inline(version: str, threshold: float, action: str = "abort") -> admin_pb.InlineProbe:
    return admin_pb.InlineProbe(manifest_json=json.dumps(version_manifest(version, threshold, action)),
                          weights_safetensors=encode_safetensors({"weight": WEIGHT, "bias": np.zeros(1)},
                                                                 "float32"))


def rows(first_elements) -> np.ndarray:
    """Rows whose first element is each of first_elements, the rest small noise."""
    values = np.asarray(first_elements, dtype=np.float32)
    out = np.random.default_rng(len(values)).normal(0, 0.1, (len(values), HIDDEN)).astype(np.float32)
    out[:, 0] = values
    return out


@dataclass
class RouterProcess:
    service: processes.Service
    metrics_port: int
    log: str

    @property
    def port(self) -> int:
        return self.service.port

    def metric(self, name: str) -> float:
        return stack.scrape(self.metrics_port).get(name, 0.0)

    async def wait_metric(self, name: str, reached, timeout: float = 30) -> float:
        return await stack.wait_metric(self.metrics_port, name, reached, timeout)


async def start_router(probes_dir: Path, log: str, *extra: str) -> RouterProcess:
    metrics_port = stack.free_port()
    service = processes.router(stack.free_port(), probes_dir, "--metrics-port", str(metrics_port),
                               "--verdict-log", log, "--router-id", "router-a", *extra, secure=False).start()
    try:
        await service.wait_health(want_serving=None, timeout=60)  # serving once a probe is loaded
    except BaseException:
        service.kill()
        raise
    return RouterProcess(service, metrics_port, log)


@contextlib.asynccontextmanager
async def admin(router: RouterProcess):
    async with router.service.channel() as channel:
        yield admin_pb_grpc.ProbeAdminServiceStub(channel)


@dataclass
class Results:
    """What the engine's side of the Session received, by request."""

    aborts: dict[str, types_pb.Verdict] = field(default_factory=dict)
    scores: dict[str, list[float]] = field(default_factory=dict)
    other: list[session_pb.SessionResponse] = field(default_factory=list)


class Engine:
    """A Session client that runs requests of known rows and collects the replies."""

    def __init__(self, router: RouterProcess):
        self.client = SessionClient(router.port)
        self.results = Results()

    async def __aenter__(self) -> "Engine":
        await self.client.open(model_info())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def catalog_lists(self, digest: str, canary: str = "", timeout: float = 10) -> None:
        """Waits until the router's catalog lists the probe at this digest, with
        this canary beside it ("": none); new requests are pinned from it."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (listed := self.client.probes.get(PROBE)) is None or (listed.digest, listed.canary.digest) != (
                digest, canary):
            assert asyncio.get_running_loop().time() < deadline, f"catalog still {self.client.probes}"
            await self.client.recv()

    def start(self, request_id: str, caller: str = "", probes=(PROBE,)) -> None:
        """request_start with each binding pinned as the engine pins it, from the
        router's catalog (a canary for the requests its hash takes)."""
        infos = pin_versions(request_id, {"router": self.client.probes}, [Wanted(p, None, True) for p in probes])
        bindings = [session_pb.SessionBinding(probe=p, digest=info.digest) for p, info in zip(probes, infos)]
        self.client.send(request_start=session_pb.RequestStart(request_id=request_id, bindings=bindings,
                                                               prompt_tokens=2, caller=caller))

    async def step(self, request_rows: dict[str, tuple[int, float]]) -> None:
        """One batch: per request one row at (position, first element); waits for its ack."""
        ids = list(request_rows)
        positions = [request_rows[r][0] for r in ids]
        step = self.client.batch(block(rows([request_rows[r][1] for r in ids]), ids, positions))
        for message in await self.client.until_ack(step):
            self._file(message)

    async def end(self, *request_ids: str) -> None:
        for rid in request_ids:
            self.client.end(rid)
        for message in await self.client.sync():
            self._file(message)

    def _file(self, message: session_pb.SessionResponse) -> None:
        kind = message.WhichOneof("message")
        if kind == "abort":
            verdict = message.abort.verdict
            assert verdict.request_id not in self.results.aborts, message
            self.results.aborts[verdict.request_id] = verdict
        elif kind == "scores":
            scores = message.scores.probe_scores
            self.results.scores.setdefault(scores.request_id, []).extend(scores.scores)
        elif kind != "ack":
            self.results.other.append(message)
