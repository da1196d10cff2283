"""Assembles and runs the engine process: gRPC server, vLLM, capture, routers."""

from __future__ import annotations

import asyncio
import logging
import signal

from common.cli import fail
from common.grpc_server import PortInUse, SERVICE_FULL_NAMES, start_server
from engine_service.runtime import EngineRuntime, EngineSettings
from engine_service.servicer import EngineServicer
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

log = logging.getLogger("engine_service")

FAILURE_POLICIES = {"fail_closed": pb.FAIL_CLOSED, "fail_open": pb.FAIL_OPEN}


def create_llm(args):
    """Starts vLLM with the capture extension and the user's engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_service.capture import capture_engine_kwargs

    engine_args = AsyncEngineArgs.from_cli_args(args)
    for key, value in capture_engine_kwargs(
        allow_unsupported_vllm=args.allow_unsupported_vllm, **vars(engine_args)
    ).items():
        setattr(engine_args, key, value)
    return AsyncLLM.from_engine_args(engine_args)


async def run(args) -> int:
    runtime_holder: dict = {}
    servicer = _LateBoundServicer(runtime_holder)
    try:
        server = await start_server(
            [(pb_grpc.add_EngineServicer_to_server, servicer, SERVICE_FULL_NAMES["Engine"])],
            args.host,
            args.port,
        )
    except PortInUse as err:
        fail("engine_service", f"--port: {err}")
    print(f"engine_service: listening on {args.host}:{server.port}; starting vLLM ...", flush=True)
    from engine_service.capture import CaptureController

    try:
        llm = create_llm(args)
    except Exception as err:  # vLLM's own start-up errors, shown as one line
        fail("engine_service", f"vLLM could not start: {type(err).__name__}: {err}")
    capture = CaptureController(llm)
    settings = EngineSettings(
        default_failure_policy=FAILURE_POLICIES[args.failure_policy],
        router_timeout_s=args.router_timeout,
    )
    runtime = EngineRuntime(llm, capture=capture, link=None, settings=settings)
    await runtime.start()
    runtime_holder["runtime"] = runtime
    await server.set_serving(True)
    print(f"engine_service: SERVING on {args.host}:{server.port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: %s running requests", len(runtime.active))
    await server.set_serving(False)
    await runtime.shutdown(abort_running=args.on_shutdown == "abort", grace_s=args.grace_period)
    await server.server.stop(grace=args.grace_period)
    llm.shutdown()
    return 0


class _LateBoundServicer(EngineServicer):
    """Listens before vLLM is up (so a busy port fails fast) and answers
    UNAVAILABLE until the runtime exists."""

    def __init__(self, holder: dict):
        self._holder = holder

    @property
    def runtime(self):
        from common.errors import Unavailable

        runtime = self._holder.get("runtime")
        if runtime is None:
            raise Unavailable("the engine is still starting")
        return runtime
