"""python -m engine_service --model PATH [--router ADDRS|dns:NAME:PORT] [--port N] [vLLM flags]

Every vLLM engine argument (--tensor-parallel-size, --pipeline-parallel-size,
--distributed-executor-backend, --max-model-len, ...) passes through unchanged.
Over several nodes the engine service is node 0 (--nnodes N --node-rank 0
--master-addr ADDR); `python -m engine_service.worker_node` runs the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from common.cli import fail, setup_logging
from common.grpc_server import MAX_MESSAGE_BYTES
from engine_service.cpu_host import engine_core_priority
from engine_service.capture.channel import DEFAULT_BACKLOG_BYTES
from engine_service.engine_core.wait import MODES as ENGINE_CORE_WAITS
from engine_service.link.config import RouterLinkConfig
from engine_service.link.send_queue import DEFAULT_SEND_QUEUE_BYTES
from engine_service.service.runtime import EngineSettings
from engine_service.request.callers import DEFAULT_MAX_QUEUED_BYTES_PER_CALLER, DEFAULT_MAX_STREAMS_PER_CALLER
from engine_service.request.validation import (
    DEFAULT_CLIENT_QUEUE_BYTES,
    DEFAULT_MAX_EXTRACTION_POINTS,
    DEFAULT_MAX_STREAMS,
    PROMPT_BYTES_PER_TOKEN,
    REQUEST_BYTES_BEYOND_PROMPT,
)
from common.security.config import CLIENT_TOKENS, LOOPBACK, add_security_flags

PROG = "engine_service"
log = logging.getLogger(PROG)


def engine_parser(prog: str, description: str):
    """A parser with every vLLM engine argument and the capture override, which
    reports bad flags in one line. The engine service and worker nodes share it,
    so one engine's nodes read the same flags the same way."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message):
            self.exit(2, f"{prog}: error: {message} (see --help)\n")

    parser = Parser(prog=prog, description=description)
    parser.add_argument(
        "--allow-untested-vllm",
        action="store_true",
        help="start even on a vLLM version capture was not verified on",
    )
    AsyncEngineArgs.add_cli_args(parser)
    # None tells check_node_flags that no address was given (vLLM's default is loopback).
    parser.set_defaults(master_addr=None)
    return parser


def parse_engine_args(parser, argv: list[str] | None, worker_node: bool):
    """Parses, checks the multi-node flags, sets up logging and checks the model path."""
    from engine_service.nodes import NodeFlagsError, check_node_flags

    args = parser.parse_args(argv)
    try:
        check_node_flags(args, worker_node)
    except NodeFlagsError as err:
        parser.error(str(err))
    setup_logging(getattr(args, "log_level", None) or "info")  # vLLM's --log-level serves both
    check_model_path(parser.prog, args.model)
    return args


def build_parser():
    parser = engine_parser(PROG, __doc__.splitlines()[0])
    ours = parser.add_argument_group("Undercurrent")
    ours.add_argument("--host", default=None,
                      help="gRPC listen address (default 0.0.0.0; with --insecure 127.0.0.1)")
    ours.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    ours.add_argument(
        "--router",
        default="",
        help="router replicas: host:port[,host:port...] or dns:NAME:PORT (re-resolved)",
    )
    ours.add_argument(
        "--routers-optional",
        action="store_true",
        help="report SERVING without a router session (probes then fail per policy)",
    )
    ours.add_argument(
        "--failure-policy",
        choices=["fail_closed", "fail_open"],
        default="fail_closed",
        help="default for bindings that set none",
    )
    ours.add_argument(
        "--guards-file", type=Path, default=None,
        help="JSON file of operator-set bindings per caller, applied to every request of theirs, which "
             "a request cannot remove or weaken (docs/security.md); re-read when it changes",
    )
    ours.add_argument("--router-timeout", type=float, default=EngineSettings.router_timeout_s,
                      help="seconds a row may wait for its router's ack before it counts unscored "
                           "(fail_closed bindings then end the request), and a request may wait "
                           "without any replica")
    ours.add_argument("--router-heartbeat-timeout", type=float, default=RouterLinkConfig.heartbeat_timeout_s,
                      help="seconds without any message from a replica (heartbeats included) before its "
                           "session counts as lost and its requests move elsewhere")
    ours.add_argument(
        "--overflow-policy",
        choices=["drop_oldest", "drop_newest"],
        default="drop_oldest",
    )
    ours.add_argument("--send-queue", type=int, default=256, help="batches per router replica")
    ours.add_argument(
        "--send-queue-bytes", type=int, default=DEFAULT_SEND_QUEUE_BYTES,
        help="bytes of batches per router replica; past either bound the overflow policy drops "
        f"(default {DEFAULT_SEND_QUEUE_BYTES}, {DEFAULT_SEND_QUEUE_BYTES >> 20} MiB)",
    )
    ours.add_argument(
        "--max-tokens-ahead", type=int, default=0,
        help="positions a probed request may compute past its first one whose rows are not yet "
        "scored; vLLM's scheduler skips it there until its router catches up, so an abort lands "
        "at most this many tokens after its trigger and a silent router stops the request "
        "(default 0: no bound)",
    )
    openai = parser.add_argument_group("OpenAI-compatible HTTP API (docs/openai.md)")
    openai.add_argument("--openai-port", type=int, default=0,
                        help="port of the OpenAI-compatible API (/v1/models, /v1/completions, "
                             "/v1/chat/completions), on --host, with the gRPC port's TLS and client tokens "
                             "(default 0: off)")
    openai.add_argument("--chat-template", default=None,
                        help="chat template for /v1/chat/completions, a file or the template itself "
                             "(default: the tokenizer's)")
    ours.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    ours.add_argument("--metrics-host", default=LOOPBACK,
                      help=f"address the metrics port listens on (default {LOOPBACK}; metrics are not "
                      "authenticated)")
    ours.add_argument(
        "--on-shutdown",
        choices=["finish", "abort"],
        default="finish",
        help="what SIGTERM does to running requests",
    )
    ours.add_argument("--grace-period", type=float, default=30.0, help="seconds")
    ours.add_argument(
        "--node-timeout", type=float, default=30.0,
        help="with --nnodes > 1: seconds every worker may take to answer the engine's liveness "
        "check (every 5 s); past it the engine reports NOT_SERVING and exits 1 so a supervisor "
        "restarts it and its worker nodes (0: no check)",
    )
    ours.add_argument(
        "--keep-off-worker-cores", action="store_true",
        help="once vLLM's CPU backend has bound its workers to cores, move this process's threads "
        "to the other cores it may use (those vLLM reserves for other processes), so they never take "
        "a core from a forward pass; nothing moves where workers are not bound (GPU) or hold every "
        "core. Off by default: on a 2-core host with one worker, every type at every layer ran as "
        "fast with it as without, alternating round by round",
    )
    ours.add_argument(
        "--engine-core-wait", choices=ENGINE_CORE_WAITS, default="auto",
        help="how vLLM's engine core waits for its workers during a forward pass: spin (vLLM's "
        "own way: it takes a core while it waits) or sleep (it sleeps until the workers reply, "
        "leaving the core to the engine service and the router). auto sleeps on vLLM's CPU "
        "backend (every type at every layer 4-8%% faster on a 2-core host) and spins elsewhere",
    )
    ours.add_argument(
        "--engine-core-nice", default="auto", metavar="auto|NICE",
        help="the nice of vLLM's engine core's threads, set once vLLM has started, so that each "
        "step's turnaround runs ahead of the engine service and the router (-10 ran every type "
        "1.5-8.6%% faster on a 2-core CPU host). auto is -10 on vLLM's "
        "CPU backend and leaves it alone elsewhere; raising it needs CAP_SYS_NICE or a nice limit "
        "(ulimit -e) of 20 - NICE, without either the service says so and goes on",
    )
    limits = parser.add_argument_group("Undercurrent limits (RESOURCE_EXHAUSTED past them)")
    limits.add_argument(
        "--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES,
        help=f"largest gRPC message sent or received, clients and routers (default {MAX_MESSAGE_BYTES}, 64 MiB)",
    )
    limits.add_argument(
        "--max-streams", type=int, default=DEFAULT_MAX_STREAMS,
        help=f"concurrent Generate streams (default {DEFAULT_MAX_STREAMS})",
    )
    limits.add_argument(
        "--max-streams-per-caller", type=int, default=DEFAULT_MAX_STREAMS_PER_CALLER,
        help="concurrent Generate streams of one caller (one client token's name) "
        f"(default {DEFAULT_MAX_STREAMS_PER_CALLER})",
    )
    limits.add_argument(
        "--max-queued-bytes-per-caller", type=int, default=DEFAULT_MAX_QUEUED_BYTES_PER_CALLER,
        help="events queued for one caller's streams and not yet read by it; past it its activations "
        f"and scores are dropped and counted (default {DEFAULT_MAX_QUEUED_BYTES_PER_CALLER}, "
        f"{DEFAULT_MAX_QUEUED_BYTES_PER_CALLER >> 20} MiB)",
    )
    limits.add_argument(
        "--max-extraction-points", type=int, default=DEFAULT_MAX_EXTRACTION_POINTS,
        help=f"extraction points per request (default {DEFAULT_MAX_EXTRACTION_POINTS})",
    )
    limits.add_argument(
        "--max-prompt-bytes", type=int, default=0,
        help="prompt.text bytes, refused (INVALID_ARGUMENT) before tokenizing "
        f"(default 0: {PROMPT_BYTES_PER_TOKEN} x max_model_len); the client port receives requests of at "
        f"most this plus {REQUEST_BYTES_BEYOND_PROMPT >> 20} MiB (RESOURCE_EXHAUSTED past it)",
    )
    limits.add_argument(
        "--client-queue-bytes", type=int, default=DEFAULT_CLIENT_QUEUE_BYTES,
        help="events queued per Generate stream; activations and scores past it are dropped and "
        f"counted (default {DEFAULT_CLIENT_QUEUE_BYTES}, 32 MiB)",
    )
    limits.add_argument(
        "--capture-backlog-bytes", type=int, default=DEFAULT_BACKLOG_BYTES,
        help="bytes of captured rows each worker holds (in the socket's queues or its own) while the "
        "engine service does not read them; past it "
        "the oldest are dropped and their requests end with an error "
        f"(default {DEFAULT_BACKLOG_BYTES}, {DEFAULT_BACKLOG_BYTES >> 20} MiB)",
    )
    add_security_flags(parser, CLIENT_TOKENS)
    return parser


def check_model_path(prog: str, model: str) -> None:
    if Path(model).exists():
        return
    if os.environ.get("HF_HUB_OFFLINE") == "1" or "/" in model and Path(model).parent.exists():
        fail(prog, f"--model: {model!r} does not exist (no model hub here; pass a local directory)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_engine_args(parser, argv, worker_node=False)
    for flag in ("max_message_bytes", "max_streams", "max_extraction_points", "client_queue_bytes",
                 "capture_backlog_bytes", "send_queue", "send_queue_bytes", "max_streams_per_caller",
                 "max_queued_bytes_per_caller"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    if args.router_timeout <= 0:
        parser.error("--router-timeout must be > 0")
    if args.router_heartbeat_timeout <= RouterLinkConfig.heartbeat_interval_s:
        parser.error(f"--router-heartbeat-timeout must exceed the {RouterLinkConfig.heartbeat_interval_s:g} s "
                     "between heartbeats")
    if args.max_prompt_bytes < 0:
        parser.error("--max-prompt-bytes must be >= 0")
    if args.node_timeout < 0:
        parser.error("--node-timeout must be >= 0")
    if args.max_tokens_ahead < 0:
        parser.error("--max-tokens-ahead must be >= 0")
    try:
        engine_core_priority.resolve(args.engine_core_nice, on_cpu=True)
    except ValueError as err:
        parser.error(f"--engine-core-nice: {err}")
    if args.max_tokens_ahead and args.scheduler_cls:
        parser.error("--max-tokens-ahead needs vLLM's scheduler class of its own; drop --scheduler-cls")
    from engine_service.service.app import run

    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
