"""Service processes on loopback: start, wait for gRPC health, stop.

Shared by the `make run` demo, the end-to-end tests and the benchmarks. Services
run with TLS and tokens from `tools.dev_security` unless started with secure=False.
"""

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
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tools.dev_security import DevSecurity

LOGS = Path(__file__).resolve().parent.parent / ".cache" / "logs"


_handed_out: set[int] = set()
# LOW-HIGH: hand out ports from this range only. `make test` gives each of its
# concurrent pytest processes a range of its own below the kernel's ephemeral
# ports, so no process (nor the kernel, binding port 0) can be handed a port
# another was given and has not bound yet.
PORTS_ENV = "UNDERCURRENT_TEST_PORTS"


def free_port() -> int:
    """A loopback port free now and not handed out before by this process. The
    kernel may give two binds in a row the same port, and a service told to
    listen on both (health and metrics) then fails to start."""
    ports = os.environ.get(PORTS_ENV)
    if ports:
        return _free_port_in(ports)
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _free_port_in(ports: str) -> int:
    try:
        low, high = (int(bound) for bound in ports.split("-"))
    except ValueError:
        raise RuntimeError(f"{PORTS_ENV}={ports!r}: expected LOW-HIGH, such as 20000-23999") from None
    for port in range(low, high + 1):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"{PORTS_ENV}={ports}: every port is busy or handed out")


@dataclass
class Service:
    """A `python -m MODULE ...` process, its loopback address and its log."""

    name: str
    args: list[str]
    port: int
    env: dict = field(default_factory=dict)
    log_to_file: bool = True
    security: DevSecurity | None = None  # None: plaintext (--insecure)
    nice: int = 0  # scheduling niceness of the process and every thread it starts
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return LOGS / f"{self.name}-{self.port}.log"

    def start(self) -> "Service":
        output = None
        if self.log_to_file:
            LOGS.mkdir(parents=True, exist_ok=True)
            output = open(self.log_path, "ab")
        # Its own process group, so kill() also ends vLLM's engine-core and worker
        # processes, but not its own session: with the kernel's scheduler
        # autogroup on (kernel.sched_autogroup_enabled=1), each session is
        # scheduled as one group, and a session holding vLLM's pinned workers
        # kept other sessions' processes (a router, a client) off both cores of
        # a 2-core host for seconds.
        self.process = subprocess.Popen(
            [sys.executable, "-m", *self.args],
            stdout=output, stderr=subprocess.STDOUT if output else None,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env),
            process_group=0,
            preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
        )
        return self

    def channel(self, token: str | None = None) -> grpc.aio.Channel:
        """A client channel to the service: TLS with the development client
        certificate and tokens, or plaintext for an --insecure service."""
        if self.security is None:
            return grpc.aio.insecure_channel(self.address)
        return self.security.channel(self.address, token)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_health(self, want_serving: bool | None = True, timeout: float = 180) -> None:
        """Waits for the health status (want_serving None: any answer at all)."""
        deadline = time.monotonic() + timeout
        async with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited ({self.process.returncode}):\n{self.log_tail()}"
                    )
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if want_serving is None or serving == want_serving:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(
            f"{self.name} health never became serving={want_serving} in {timeout:.0f} s:\n"
            f"{self.log_tail()}"
        )

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM (graceful shutdown), then SIGKILL to the group if it does not exit."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the whole process group: the service and every child it spawned."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def vllm_engine_core(service: Service) -> psutil.Process:
    """vLLM's engine-core child of an engine process (titled VLLM::EngineCore...);
    its own children are the workers of a multi-worker engine."""
    return engine_core_under(service.process.pid, service.name)


def thread_nices(pid: int) -> list[int]:
    """The nice of each thread of process `pid` (Linux keeps one per thread)."""
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def engine_core_under(pid: int, name: str) -> psutil.Process:
    """vLLM's engine core among the descendants of process `pid` (an engine
    service, or a container's main process seen from the host)."""
    children = psutil.Process(pid).children(recursive=True)
    cores = [p for p in children if "EngineCore" in " ".join(p.cmdline())]
    if len(cores) != 1:
        raise RuntimeError(f"expected one vLLM engine core under {name}, found: "
                           f"{[p.cmdline() for p in children]}")
    return cores[0]


def _security(secure: bool) -> DevSecurity | None:
    return DevSecurity.ensure() if secure else None


def router(port: int, probes_dir: Path, *extra: str, log_to_file: bool = True,
           secure: bool = True, nice: int = 0) -> Service:
    security = _security(secure)
    flags = security.router_flags() if security else ["--insecure"]
    return Service(
        "router",
        ["router_service", "--host", "127.0.0.1", "--port", str(port), "--probes", str(probes_dir),
         *flags, *extra],
        port,
        log_to_file=log_to_file,
        security=security,
        nice=nice,
    )


def engine(model: str, router_addresses: str, *extra: str, workers_bind: str | None = None,
           log_to_file: bool = True, max_model_len: int = 512, secure: bool = True,
           dtype: str = "float32", log_stats: bool = False) -> Service:
    """An engine serving `model` in `dtype` (vLLM's --dtype; float32 unless asked);
    log_stats: keep vLLM's statistics (its vllm:* series)."""
    port = free_port()
    security = _security(secure)
    args = ["engine_service", "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--max-model-len", str(max_model_len), "--dtype", dtype,
            *([] if log_stats else ["--disable-log-stats"]),
            *(security.engine_flags() if security else ["--insecure"]), *extra]
    if router_addresses:
        args += ["--router", router_addresses]
    env = {"VLLM_CPU_OMP_THREADS_BIND": workers_bind} if workers_bind else {}
    return Service("engine", args, port, env, log_to_file, security)


def worker_node(model: str, node_rank: int, node_flags: list[str], *extra: str,
                workers_bind: str | None = None, max_model_len: int = 512) -> Service:
    """Node `node_rank` of a multi-node engine whose node 0 is an engine service
    started with the same `node_flags` (--nnodes, --master-addr, --master-port,
    parallelism). It serves no port of its own; its log is named by its rank."""
    args = ["engine_service.worker_node", "--model", model, "--max-model-len", str(max_model_len),
            "--dtype", "float32", "--disable-log-stats", *node_flags, "--node-rank", str(node_rank), *extra]
    env = {"VLLM_CPU_OMP_THREADS_BIND": workers_bind} if workers_bind else {}
    return Service(f"worker-node{node_rank}", args, free_port(), env)
