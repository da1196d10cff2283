"""Real engine and router processes on loopback, and gRPC clients for them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import channel_options
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

LOGS = Path(__file__).resolve().parents[2] / ".cache" / "test-logs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """A service process, its address and its log file."""

    name: str
    args: list[str]
    port: int
    env: dict = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return LOGS / f"{self.name}-{self.port}.log"

    def start(self) -> "Service":
        LOGS.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Its own process group, so kill() also ends vLLM's engine-core and worker processes.
        self.process = subprocess.Popen(
            [sys.executable, "-m", *self.args],
            stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env),
            start_new_session=True,
        )
        return self

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_health(self, want_serving: bool | None = True, timeout: float = 180) -> None:
        """Waits for the health status (want_serving None: any answer at all)."""
        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.process.returncode}):\n{self.log_tail()}")
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if want_serving is None or serving == want_serving:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.name} health never became serving={want_serving}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to the whole process group: the service and every child it spawned."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def terminate(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


def router(port: int, probes_dir: Path, *extra: str) -> Service:
    return Service(
        "router",
        ["router_service", "--host", "127.0.0.1", "--port", str(port), "--probes", str(probes_dir),
         "--heartbeat-interval", "1", *extra],
        port,
    )


def engine(model: str, router_addresses: str, *extra: str, workers_bind: str | None = None) -> Service:
    port = free_port()
    args = ["engine_service", "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--max-model-len", "512", "--dtype", "float32", "--disable-log-stats",
            "--router-timeout", "1.5", *extra]
    if router_addresses:
        args += ["--router", router_addresses]
    env = {"VLLM_CPU_OMP_THREADS_BIND": workers_bind} if workers_bind else {}
    return Service("engine", args, port, env)


@dataclass
class Outcome:
    """Everything one Generate stream returned."""

    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    scores: list[pb.ProbeScores] = field(default_factory=list)
    batches: list[pb.ActivationBatch] = field(default_factory=list)
    finished: pb.GenerateFinished | None = None

    @property
    def reason(self) -> str:
        return pb.FinishReason.Name(self.finished.finish_reason)


async def generate(stub: pb_grpc.EngineStub, request: pb.GenerateRequest, timeout=120,
                   scored: asyncio.Event | None = None) -> Outcome:
    """Runs one Generate stream to its end; sets `scored` at the first probe event."""
    outcome = Outcome()
    async for response in stub.Generate(request, timeout=timeout):
        kind = response.WhichOneof("event")
        if kind == "started":
            outcome.request_id = response.started.request_id
        elif kind == "tokens":
            assert response.tokens.first_index == len(outcome.tokens)
            outcome.tokens.extend(response.tokens.token_ids)
            outcome.text += response.tokens.text
        elif kind == "probe_event":
            outcome.scores.append(response.probe_event.scores)
            if scored is not None:
                scored.set()
        elif kind == "activations":
            outcome.batches.append(response.activations)
        elif kind == "finished":
            outcome.finished = response.finished
    assert outcome.finished is not None, "the stream ended without a finished message"
    return outcome


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options())


async def wait_for_probe(stub: pb_grpc.EngineStub, probe: str, timeout: float = 30) -> None:
    """Waits until the engine's router catalog offers `probe` (catalogs propagate
    asynchronously after a router starts or loads a probe)."""
    deadline = time.monotonic() + timeout
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                 sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    request.probes.add(probe=probe, failure_policy=pb.FAIL_OPEN)
    while True:
        try:
            await generate(stub, request)
            return
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)
