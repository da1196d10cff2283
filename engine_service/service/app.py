"""Assembles and runs the engine process: gRPC server, vLLM, capture, routers."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid

from common.cli import fail
from common.errors import Unavailable
from common.gc_heap import freeze_startup_heap
from common.grpc_server import PortInUse, PortLimits, SERVICE_FULL_NAMES, start_server
from common.security.config import SecurityConfigError, engine_security, listen_host
from common.security.tls import ChannelFactory
from engine_service.request.callers import CallerLimits, Callers
from engine_service.service.servicer import EngineServicer
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

log = logging.getLogger("engine_service")

FAILURE_POLICIES = {"fail_closed": types_pb.FAILURE_POLICY_FAIL_CLOSED, "fail_open": types_pb.FAILURE_POLICY_FAIL_OPEN}
HEALTH_POLL_S = 0.5
# After vLLM's engine core stopped or a node was lost, running requests get this
# long to end before the process exits.
ENGINE_LOSS_EXIT_S = 10.0
# Calls the client port serves beside the Generate streams: Abort, GetModelInfo,
# health, and refused calls on their way out.
OTHER_CALLS = 256


def create_llm(args, allowances=None):
    """Starts vLLM with the capture extension and the user's engine arguments;
    with `allowances` (an AllowancePublisher), with the scheduler that holds
    probed requests at their allowance."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_service.engine_core import wait as engine_core_wait
    from engine_service.capture.driver.controller import enable_capture
    from engine_service.engine_core.tokens_ahead import ADDRESS_ENV, SCHEDULER_CLS

    enable_capture(args)
    wait = engine_core_wait.choose(args.engine_core_wait, current_platform.is_cpu())
    log.info("vLLM's engine core %s while its workers compute (--engine-core-wait %s)",
             "sleeps" if wait == "sleep" else "spins", args.engine_core_wait)
    if allowances is not None:
        os.environ[ADDRESS_ENV] = allowances.address  # vLLM's engine core inherits it
        args.scheduler_cls = SCHEDULER_CLS
    return AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))


def request_limits(args):
    from engine_service.request.validation import RequestLimits

    return RequestLimits(
        max_streams=args.max_streams,
        max_extraction_points=args.max_extraction_points,
        max_prompt_bytes=args.max_prompt_bytes,
        max_message_bytes=args.max_message_bytes,
        client_queue_bytes=args.client_queue_bytes,
    )


def client_port_limits(args, max_model_len: int) -> PortLimits:
    """The client port receives requests no larger than a prompt that can fit
    plus the rest of a request, and sends activations up to --max-message-bytes."""
    calls = args.max_streams + OTHER_CALLS
    return PortLimits(max_send_bytes=args.max_message_bytes,
                      max_receive_bytes=request_limits(args).request_bytes(max_model_len),
                      max_concurrent_rpcs=calls, max_streams_per_connection=calls)


def model_max_len(args) -> int:
    """vLLM's max_model_len for these arguments, read from the model's config
    before vLLM starts (the client port's receive limit depends on it)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        return AsyncEngineArgs.from_cli_args(args).create_model_config().max_model_len
    except Exception as err:  # vLLM's own configuration errors, shown as one line
        fail("engine_service", f"vLLM could not start: {type(err).__name__}: {err}")


def link_config(args, client_tls):
    from engine_service.link import RouterLinkConfig
    from common.router_targets import DnsTarget, parse_targets

    if not args.router:
        return None
    try:
        targets = parse_targets(args.router)
        return RouterLinkConfig(
            targets=args.router,
            engine_id=f"engine-{uuid.uuid4().hex[:8]}",
            router_timeout_s=args.router_timeout,
            heartbeat_timeout_s=args.router_heartbeat_timeout,
            queue_max_batches=args.send_queue,
            queue_max_bytes=args.send_queue_bytes,
            overflow_policy=args.overflow_policy,
            max_message_bytes=args.max_message_bytes,
            # Replicas found through DNS are dialled by address but must prove the name.
            open_channel=ChannelFactory(
                client_tls, targets.host if isinstance(targets, DnsTarget) else None
            ),
        )
    except ValueError as err:
        fail("engine_service", f"--router: {err}")


def bind_openai_port(args, host: str):
    """The OpenAI API's socket (None without --openai-port), bound before vLLM
    starts so a busy port fails fast."""
    from engine_service.openai_api.server import bind

    if not args.openai_port:
        return None
    try:
        return bind(host, args.openai_port)
    except OSError as err:
        fail("engine_service", f"--openai-port: cannot listen on {host}:{args.openai_port}: {err.strerror}")


async def start_openai(args, sock, runtime, callers, security, llm):
    """Serves the OpenAI API on `sock` (None: not at all) with the gRPC port's
    TLS files and client tokens, and vLLM's chat-template renderer."""
    if sock is None:
        return None
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer

    from common.security.config import ENGINE_SERVICE
    from engine_service.openai_api.server import OpenAIFront, serve

    model_config = llm.vllm_config.model_config
    renderer = OnlineRenderer(model_config, llm.renderer, request_logger=None,
                              chat_template=load_chat_template(args.chat_template),
                              chat_template_content_format="auto")
    access = security.access.get(ENGINE_SERVICE)
    front = OpenAIFront(runtime, callers, access.tokens if access else None, model_config.served_model_name,
                        renderer, request_limits(args).request_bytes(model_config.max_model_len))
    served = await serve(front, sock, security.tls.ssl_context() if security.tls else None)
    scheme = "https" if security.tls else "http"
    print(f"engine_service: OpenAI API on {scheme}://{sock.getsockname()[0]}:{sock.getsockname()[1]}/v1",
          flush=True)
    return served


async def stop_openai(served) -> None:
    if served is None:
        return
    server, task = served
    server.should_exit = True
    await asyncio.gather(task, return_exceptions=True)


def load_guards(args, links):
    """The operator-set bindings of --guards-file (None without it); a bad file
    fails before anything starts."""
    from engine_service.request.guards import GuardConfigError, GuardsFile, describe

    if args.guards_file is None:
        return None
    if links is None:
        fail("engine_service", "--guards-file: needs --router (guards are probes the routers run)")
    try:
        guards = GuardsFile(args.guards_file)
    except GuardConfigError as err:
        fail("engine_service", str(err))
    log.info("guards from %s: default %s", args.guards_file,
             ", ".join(map(describe, guards.for_caller(""))) or "none")
    return guards


async def run(args) -> int:
    from vllm.platforms import current_platform

    from engine_service.cpu_host import engine_core_priority
    from engine_service.capture.driver.controller import CaptureController
    from engine_service.cpu_host.host_checks import autogroup_warning
    from engine_service.service.metrics import EngineMetrics
    from engine_service.cpu_host.placement import place_engine_service
    from engine_service.service.runtime import EngineRuntime, EngineSettings
    from engine_service.engine_core.tokens_ahead import AllowancePublisher

    try:  # TLS files and tokens: read now, so a bad one fails before anything starts
        security, client_tls = engine_security(args)
    except SecurityConfigError as err:
        fail("engine_service", str(err))
    links = link_config(args, client_tls)  # bad --router fails before anything starts
    guards = load_guards(args, links)
    metrics = EngineMetrics(include_vllm=bool(args.metrics_port))
    host = listen_host(args)
    holder: dict = {}
    callers = Callers(CallerLimits(args.max_streams_per_caller, args.max_queued_bytes_per_caller))
    try:
        server = await start_server(
            [(engine_pb_grpc.add_EngineServiceServicer_to_server, _StartingServicer(holder, callers),
              SERVICE_FULL_NAMES["EngineService"])],
            host,
            args.port,
            client_port_limits(args, model_max_len(args)),
            security=security,
            metrics_registry=metrics.registry,
        )
    except PortInUse as err:
        fail("engine_service", f"--port: {err}")
    openai_socket = bind_openai_port(args, host)
    print(f"engine_service: listening on {host}:{server.port}; starting vLLM ...", flush=True)
    allowances = AllowancePublisher(args.max_tokens_ahead) if args.max_tokens_ahead else None
    try:
        llm = create_llm(args, allowances)
    except Exception as err:  # vLLM's own start-up errors, shown as one line
        fail("engine_service", f"vLLM could not start: {type(err).__name__}: {err}")
    log.info("%s", engine_core_priority.apply(
        args.engine_core_nice, current_platform.is_cpu(), engine_core_priority.engine_core_pids(llm)))
    if warning := autogroup_warning(on_cpu=current_platform.is_cpu()):
        log.warning("%s", warning)
    if args.metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
        except OSError as err:
            fail("engine_service", f"--metrics-port: cannot listen on {args.metrics_host}:{args.metrics_port}: "
                 f"{err.strerror}")
    runtime = EngineRuntime(
        llm,
        CaptureController(llm, backlog_bytes=args.capture_backlog_bytes),
        link_config=links,
        settings=EngineSettings(
            default_failure_policy=FAILURE_POLICIES[args.failure_policy],
            router_timeout_s=args.router_timeout,
            limits=request_limits(args),
            node_timeout_s=args.node_timeout if args.nnodes > 1 and args.node_timeout > 0 else None,
        ),
        metrics=metrics,
        allowances=allowances,
        guards=guards,
    )
    if args.keep_off_worker_cores:
        await place_engine_service(runtime.capture)
    await runtime.start()
    holder["runtime"] = runtime
    openai_http = await start_openai(args, openai_socket, runtime, callers, security, llm)
    log.info("start-up heap frozen: %d objects", freeze_startup_heap())
    stop = asyncio.Event()
    health = asyncio.create_task(
        _track_health(server, runtime, args.routers_optional or not links, stop)
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    health.cancel()
    await server.set_serving(False)
    if runtime.engine_lost is not None:
        return await _exit_after_engine_loss(server, runtime)
    log.info("shutting down: %d running requests (%s them)", len(runtime.active), args.on_shutdown)
    await runtime.shutdown(abort_running=args.on_shutdown == "abort", grace_s=args.grace_period)
    await stop_openai(openai_http)
    await server.stop(grace=5)
    llm.shutdown()
    return 0


async def _exit_after_engine_loss(server, runtime) -> int:
    """vLLM never recovers from a stopped engine core, and a lost node leaves it
    waiting for good: end what can be ended within a bound and exit 1, so a
    supervisor restarts the engine (and every worker node rejoins it). vLLM's own
    shutdown would wait for a lost node."""
    log.error("exiting: %s", runtime.engine_lost)
    try:
        await asyncio.wait_for(
            runtime.shutdown(
                abort_running=True, grace_s=0, why=f"engine error: {runtime.engine_lost}"
            ),
            ENGINE_LOSS_EXIT_S,
        )
    except TimeoutError:
        log.error("requests did not end within %.0f s; exiting anyway", ENGINE_LOSS_EXIT_S)
    await server.stop(grace=1)
    return 1


async def _track_health(server, runtime, routers_optional: bool, stop: asyncio.Event) -> None:
    """SERVING while every worker answers, the drain loop runs and at least one
    router session is up (unless optional); a stopped engine core or a lost
    node stops the process."""
    serving = None
    while True:
        now, why_not = runtime.health(routers_optional)
        if now != serving:
            serving = now
            await server.set_serving(now)
            state = "SERVING" if now else f"NOT_SERVING ({why_not})"
            print(f"engine_service: {state}; {runtime.routers_up()} router(s) up", flush=True)
        if runtime.engine_lost is not None:
            stop.set()
            return
        await asyncio.sleep(HEALTH_POLL_S)


class _StartingServicer(EngineServicer):
    """Listens before vLLM is up (so a busy port fails fast) and answers
    UNAVAILABLE until the runtime exists."""

    def __init__(self, holder: dict, callers: Callers):
        self._holder = holder
        self.callers = callers

    @property
    def runtime(self):
        runtime = self._holder.get("runtime")
        if runtime is None:
            raise Unavailable("the engine is still starting")
        return runtime
