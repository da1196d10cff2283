"""A running router: registry, servicers, gRPC server, health and shutdown.

Health is NOT_SERVING until start-up loading finished, and afterwards SERVING
exactly while at least one probe is loaded and the router is not draining.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from common.grpc_server import MAX_MESSAGE_BYTES, SERVICE_FULL_NAMES, PortLimits, ServerHandle, start_server
from common.security.config import ServerSecurity
from router_service.metrics import RouterMetrics
from common.probe_format.files import DEFAULT_MAX_INLINE_PROBE_BYTES, ProbeRoot, load_probe_path, probe_paths
from router_service.registry import ProbeRegistry
from router_service.servicers import AdminServicer, LiveSession, SessionServicer
from router_service.session import DEFAULT_MAX_REQUESTS_PER_SESSION
from router_service.verdict_log import LogSettings, VerdictLog
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent.v1 import router_session_pb2_grpc as session_pb_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 256
# Calls beyond the sessions a router serves at once: admin calls, health checks.
OTHER_CALLS = 256
# An engine opens one Session per channel; admin tools make a few calls at a time.
STREAMS_PER_CONNECTION = 16
SESSION_CLOSE_TIMEOUT_S = 5.0  # after the server stopped: how long its Session handlers get to clean up


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    probes_dir: Path | None = None
    heartbeat_interval: float = 5.0  # seconds between the router's own heartbeats
    grace_period: float = 30.0  # seconds a drain waits for active requests to end
    scores_interval: float = 0.0  # minimum seconds between ProbeScores per binding; 0: every step
    router_id: str = ""  # default: hostname:pid
    scoring_threads: int = 2  # for batches over INLINE_SCORING_BYTES; smaller ones score inline
    max_message_bytes: int = MAX_MESSAGE_BYTES  # gRPC send and receive limit
    max_sessions: int = DEFAULT_MAX_SESSIONS  # open engine sessions; more get RESOURCE_EXHAUSTED
    max_requests_per_session: int = DEFAULT_MAX_REQUESTS_PER_SESSION  # live requests per session
    security: ServerSecurity | None = None  # None: plaintext, no tokens (in-process tests)
    max_inline_probe_bytes: int = DEFAULT_MAX_INLINE_PROBE_BYTES  # larger inline LoadProbe: RESOURCE_EXHAUSTED
    probe_root: ProbeRoot | None = None  # where LoadProbe by path may read; None: path loads refused
    health_port: int | None = None  # grpc.health.v1 in plaintext on 127.0.0.1 (0: any free port)
    verdict_log: LogSettings | None = None  # None: verdicts are not logged

    def port_limits(self) -> PortLimits:
        return PortLimits(max_send_bytes=self.max_message_bytes, max_receive_bytes=self.max_message_bytes,
                          max_concurrent_rpcs=self.max_sessions + OTHER_CALLS,
                          max_streams_per_connection=STREAMS_PER_CONNECTION)


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.router_id = config.router_id or f"{socket.gethostname()}:{os.getpid()}"
        self.registry = ProbeRegistry()
        self.metrics = RouterMetrics()
        self.sessions: set[LiveSession] = set()
        self.draining = False
        self.executor = concurrent.futures.ThreadPoolExecutor(
            config.scoring_threads, thread_name_prefix="router-score"
        )
        self.handle: ServerHandle | None = None
        self.verdict_log: VerdictLog | None = None
        self._started = False
        self._stopped = asyncio.Event()
        self._no_sessions = asyncio.Event()
        self._no_sessions.set()
        self._health_tasks: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        return self.handle.port

    def session_opened(self, session: LiveSession) -> None:
        self.sessions.add(session)
        self._no_sessions.clear()
        self.metrics.sessions.inc()

    def session_closed(self, session: LiveSession) -> None:
        self.sessions.discard(session)
        self.metrics.sessions.dec()
        if not self.sessions:
            self._no_sessions.set()

    def live_requests(self) -> int:
        return sum(len(s.state.requests) for s in self.sessions)

    def load_startup_probes(self) -> None:
        """Loads every probe of --probes; the first bad one raises ProbeFileError."""
        if self.config.probes_dir is None:
            return
        for path in probe_paths(self.config.probes_dir):
            self.registry.load(load_probe_path(path))

    async def start(self) -> None:
        self.load_startup_probes()
        if self.config.verdict_log is not None:
            self.verdict_log = await asyncio.to_thread(VerdictLog, self.config.verdict_log, self.metrics.verdict_log)
        self.registry.subscribe(self._on_probes_changed)
        self.handle = await start_server(
            [
                (session_pb_grpc.add_ProbeRouterServiceServicer_to_server, SessionServicer(self),
                 SERVICE_FULL_NAMES["ProbeRouterService"]),
                (admin_pb_grpc.add_ProbeAdminServiceServicer_to_server, AdminServicer(self),
                 SERVICE_FULL_NAMES["ProbeAdminService"]),
            ],
            self.config.host,
            self.config.port,
            self.config.port_limits(),
            security=self.config.security,
            metrics_registry=self.metrics.registry,
            health_port=self.config.health_port,
        )
        self._started = True
        self.metrics.probes_loaded.set(len(self.registry))
        await self._update_health()
        log.info("router started", extra={"router_id": self.router_id, "port": self.port,
                                          "probes": [p.name for p in self.registry.probes()]})

    def drain_message(self) -> session_pb.SessionResponse:
        return session_pb.SessionResponse(drain=session_pb.Drain(reason=f"router {self.router_id} is shutting down"))

    async def shutdown(self, grace_period: float | None = None) -> None:
        """Drains: NOT_SERVING, Drain to every session, new requests refused; then
        stops once active requests ended or the grace period ran out."""
        if self.draining:
            await self._stopped.wait()
            return
        grace = self.config.grace_period if grace_period is None else grace_period
        self.draining = True
        await self._update_health()
        log.info("draining", extra={"sessions": len(self.sessions), "live_requests": self.live_requests(),
                                    "grace_period": grace})
        for session in list(self.sessions):
            session.spawn(session.outbox.put(self.drain_message()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.live_requests() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.live_requests()
        await self.handle.stop(grace=1.0)
        # stop() cancels the Session handlers; their clean-up (requests freed, "session
        # closed") runs after it returns, and "stopped" must be the last word.
        try:
            await asyncio.wait_for(self._no_sessions.wait(), timeout=SESSION_CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("sessions still closing at stop", extra={"sessions": len(self.sessions)})
        self.executor.shutdown(wait=True)
        if self.verdict_log is not None:
            await asyncio.to_thread(self.verdict_log.close)
        log.info("stopped", extra={"requests_cut_off": left})
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _on_probes_changed(self) -> None:
        self.metrics.probes_loaded.set(len(self.registry))
        task = asyncio.get_running_loop().create_task(self._update_health())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _update_health(self) -> None:
        if self.handle is not None:
            await self.handle.set_serving(self._started and len(self.registry) > 0 and not self.draining)
