"""The router's command line: python -m router_service --port N --probes DIR.

Bad input (unknown flag, missing probes dir, a probe that fails to load, a port
in use) exits with status 2 and a one-line error on stderr, no traceback.
SIGTERM or SIGINT drain the router, then stop it (see server.Router.shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from prometheus_client import start_http_server

from common.gc_heap import freeze_startup_heap
from common.grpc_server import MAX_MESSAGE_BYTES, PortInUse
from common.security.config import (
    ADMIN_TOKENS,
    LOOPBACK,
    SecurityConfigError,
    add_router_identity_flags,
    add_security_flags,
    listen_host,
    router_security,
)
from router_service import logs
from common.probe_format.files import (
    DEFAULT_MAX_INLINE_PROBE_BYTES,
    DEFAULT_MAX_PROBE_FILE_BYTES,
    ProbeFileError,
    ProbeRoot,
)
from router_service.server import DEFAULT_MAX_SESSIONS, Router, RouterConfig
from router_service.session import DEFAULT_MAX_REQUESTS_PER_SESSION
from common.verdict_log.records import DEFAULT_MAX_ROWS
from common.verdict_log.store import StoreError
from router_service.verdict_log import DEFAULT_QUEUE, LogSettings

log = logging.getLogger(__name__)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise SystemExit(_fail(message))


def _fail(message: str) -> int:
    print(f"router_service: error: {message}", file=sys.stderr)
    return 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m router_service", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="gRPC port (0: any free port)")
    parser.add_argument("--probes", type=Path, required=True,
                        help="directory of probes to load at start-up (may be empty)")
    parser.add_argument("--probe-root", type=Path, default=None,
                        help="directory ProbeAdmin.LoadProbe may load probes from by path, nothing outside it "
                             "(default: --probes)")
    parser.add_argument("--host", default=None,
                        help="address to listen on (default 0.0.0.0; with --insecure 127.0.0.1)")
    parser.add_argument("--health-port", type=int, default=None,
                        help=f"also serve gRPC health alone, in plaintext, on {LOOPBACK}:PORT, for container "
                             "health checks that hold no client certificate")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics over HTTP on this port")
    parser.add_argument("--metrics-host", default=LOOPBACK,
                        help=f"address the metrics port listens on (default {LOOPBACK}; metrics are not "
                             "authenticated)")
    parser.add_argument("--heartbeat-interval", type=float, default=5.0,
                        help="seconds between the router's own heartbeats (default 5)")
    parser.add_argument("--grace-period", type=float, default=30.0,
                        help="seconds a drain waits for active requests to end (default 30)")
    parser.add_argument("--scores-interval", type=float, default=0.0,
                        help="minimum seconds between ProbeScores messages per binding (default 0: every step)")
    parser.add_argument("--router-id", default="", help="name reported in RouterHello (default host:pid)")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES,
                        help=f"largest gRPC message sent or received (default {MAX_MESSAGE_BYTES}, 64 MiB)")
    parser.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                        help="open engine sessions; one more is refused with RESOURCE_EXHAUSTED "
                             f"(default {DEFAULT_MAX_SESSIONS})")
    parser.add_argument("--max-requests-per-session", type=int, default=DEFAULT_MAX_REQUESTS_PER_SESSION,
                        help="live requests per engine session; request_start beyond it gets an in-band "
                             f"RESOURCE_EXHAUSTED error (default {DEFAULT_MAX_REQUESTS_PER_SESSION})")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--max-inline-probe-bytes", type=int, default=DEFAULT_MAX_INLINE_PROBE_BYTES,
                        help="largest inline LoadProbe (manifest + weights) accepted; larger ones get "
                             f"RESOURCE_EXHAUSTED (default {DEFAULT_MAX_INLINE_PROBE_BYTES})")
    parser.add_argument("--max-probe-file-bytes", type=int, default=DEFAULT_MAX_PROBE_FILE_BYTES,
                        help="largest probe LoadProbe reads by path (its files together); larger ones get "
                             f"RESOURCE_EXHAUSTED (default {DEFAULT_MAX_PROBE_FILE_BYTES})")
    parser.add_argument("--verdict-log", default=None, metavar="PATH|URL",
                        help="keep every verdict and abort durably: an SQLite file PATH, or a postgresql:// URL "
                             "for a fleet of routers sharing one log (default: no log)")
    parser.add_argument("--verdict-log-queue", type=int, default=DEFAULT_QUEUE,
                        help="verdict records waiting for the store; past it they are dropped and counted "
                             f"(default {DEFAULT_QUEUE})")
    parser.add_argument("--verdict-log-max-rows", type=int, default=DEFAULT_MAX_ROWS,
                        help="input rows kept with each abort, for replay; 0 keeps none "
                             f"(default {DEFAULT_MAX_ROWS})")
    add_security_flags(parser, ADMIN_TOKENS)
    add_router_identity_flags(parser)
    args = parser.parse_args(argv)
    for flag in ("max_inline_probe_bytes", "max_probe_file_bytes"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    if not args.probes.is_dir():
        parser.error(f"--probes {args.probes}: not a directory")
    if args.health_port is not None and args.health_port < 0:
        parser.error("--health-port must be >= 0")
    if args.probe_root is not None and not args.probe_root.is_dir():
        parser.error(f"--probe-root {args.probe_root}: not a directory")
    if args.verdict_log_max_rows < 0:
        parser.error("--verdict-log-max-rows must be >= 0")
    for flag in ("heartbeat_interval", "grace_period", "max_message_bytes", "max_sessions",
                 "max_requests_per_session", "verdict_log_queue"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    return args


def check_port_free(host: str, port: int) -> None:
    """Fails before gRPC tries, so a taken port is one clear line, not a C-core log."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise PortInUse(f"cannot listen on {host}:{port}: {err.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                raise PortInUse(f"cannot listen on {host}:{port}: {err.strerror}") from None


async def serve(args: argparse.Namespace) -> None:
    # Every caller (engines, operators) must present a certificate from --tls-ca.
    security = router_security(args)
    host = listen_host(args)
    check_port_free(host, args.port)
    router = Router(
        RouterConfig(
            host=host,
            port=args.port,
            probes_dir=args.probes,
            heartbeat_interval=args.heartbeat_interval,
            grace_period=args.grace_period,
            scores_interval=args.scores_interval,
            router_id=args.router_id,
            max_message_bytes=args.max_message_bytes,
            max_sessions=args.max_sessions,
            max_requests_per_session=args.max_requests_per_session,
            security=security,
            max_inline_probe_bytes=args.max_inline_probe_bytes,
            probe_root=ProbeRoot(args.probe_root or args.probes, args.max_probe_file_bytes),
            health_port=args.health_port,
            verdict_log=(LogSettings(args.verdict_log, args.verdict_log_queue, args.verdict_log_max_rows)
                         if args.verdict_log else None),
        )
    )
    await router.start()
    log.info("start-up heap frozen", extra={"objects": freeze_startup_heap()})
    if args.metrics_port is not None:
        try:
            start_http_server(args.metrics_port, addr=args.metrics_host, registry=router.metrics.registry)
        except OSError as err:
            raise PortInUse(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: "
                            f"{err.strerror}") from None
    print(f"router listening on {host}:{router.port}", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: loop.create_task(router.shutdown()))
    await router.wait_stopped()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure(args.log_level)
    try:
        asyncio.run(serve(args))
    except (ProbeFileError, PortInUse, SecurityConfigError, StoreError) as err:
        return _fail(str(err))
    return 0
