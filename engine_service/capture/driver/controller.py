"""Driver side of capture, next to vLLM's AsyncLLM.

    kwargs = capture_engine_kwargs(model=..., tensor_parallel_size=2)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    controller = CaptureController(engine)
    await controller.start()                 # before the first generate()
    controller.validate(points)              # InvalidArgument names the point
    params = require_prompt_computation(params, points, prompt_tokens)
    await controller.register(request_id, points, prompt_tokens)
    ... engine.generate(prompt, params, request_id) ...
    blocks = await controller.drain()        # in a loop: waits for the next rows
    await controller.unregister(request_id)  # when the request ends

Control calls (start, register, unregister) fan out to every worker with one
collective_rpc, which vLLM runs between engine steps. Rows do not take that
road: each shipping worker pushes them when its forward pass ends
(`capture.channel`), and drain() waits on that socket, so capturing costs the
engine core no round trip per step. Workers on another host are drained by
collective_rpc instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter, defaultdict
from typing import Any

from common.activations import Block, decode_parts
from common.capture_spec import ExtractionPoint, needs_prompt_positions
from common.errors import FailedPrecondition
from engine_service.capture import CaptureUnavailable
from engine_service.capture.graphs import keep_sites_in_graphs
from engine_service.capture.driver.merge import (
    DeliveredPositions,
    ForwardOrderGate,
    merge_blocks,
)
from engine_service.capture.channel import DEFAULT_BACKLOG_BYTES, node_identity
from engine_service.capture.driver.sink import Sink
from engine_service.capture.driver.topology import RankTopology, Topology
from undercurrent.v1 import types_pb2 as types_pb

log = logging.getLogger(__name__)

WORKER_EXTENSION = "engine_service.capture.worker.extension.CaptureWorkerExtension"
# vLLM minor versions whose internals (request-id suffixes, V1 runner batch
# layout, worker extension mixing) this capture was verified against.
SUPPORTED_VLLM_VERSIONS = ("0.32",)
ALLOW_UNTESTED_VLLM_ENV = "UNDERCURRENT_ALLOW_UNTESTED_VLLM"
# drain() waits at most this long for rows (or, while nothing is registered, for a
# registration) before it returns empty, so its caller's loop never spins. A
# register or unregister ends the wait at once, so nothing waits this long for a
# drain; it is long because every empty return is a wake-up of the drain loop,
# whose CPU the forward pass shares (10 ms gave ~10 per 100 ms step).
DRAIN_WAIT_S = 0.1
# How long drain() waits for the last rows of an ending request before it gives up
# on them (logged); they were pushed before the request's unregister returned.
BARRIER_TIMEOUT_S = 5.0


# The key capture adds to vLLM's `additional_config` (part of its compile cache key).
SITES_CONFIG_KEY = "undercurrent_capture_sites"


def check_vllm_version(version: str | None = None, allow_untested: bool = False) -> str:
    """Refuses a vLLM version capture was not verified on, unless explicitly overridden."""
    if version is None:
        import vllm

        version = vllm.__version__
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor in SUPPORTED_VLLM_VERSIONS:
        return version
    if allow_untested or os.environ.get(ALLOW_UNTESTED_VLLM_ENV) == "1":
        log.warning(
            "capture: vLLM %s is untested (supported: %s); running because the override is set",
            version,
            ", ".join(f"{v}.x" for v in SUPPORTED_VLLM_VERSIONS),
        )
        return version
    raise CaptureUnavailable(
        f"vLLM {version} is not supported for activation capture; supported versions: "
        f"{', '.join(f'{v}.x' for v in SUPPORTED_VLLM_VERSIONS)}. Set "
        f"{ALLOW_UNTESTED_VLLM_ENV}=1 to run anyway."
    )


def capture_engine_kwargs(allow_untested_vllm: bool = False, **user_kwargs: Any) -> dict:
    """AsyncEngineArgs keyword arguments with capture switched on.

    Refuses what would make hooks see wrong rows or no rows, rather than
    letting capture be silently wrong.
    """
    check_vllm_version(allow_untested=allow_untested_vllm)
    kwargs = dict(user_kwargs)
    if kwargs.get("speculative_config"):
        raise CaptureUnavailable(
            "speculative decoding is not supported with activation capture: draft rows in "
            "the batch may be rejected, and their activations would reach probes"
        )
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
        raise CaptureUnavailable(
            "VLLM_USE_V2_MODEL_RUNNER is set: the V2 model runner lays out batch rows "
            "differently and is not supported by activation capture; unset it"
        )
    extension = kwargs.get("worker_extension_cls")
    if extension and extension != WORKER_EXTENSION:
        raise CaptureUnavailable(
            f"worker_extension_cls is already set to {extension!r}; capture needs {WORKER_EXTENSION!r}"
        )
    kwargs["worker_extension_cls"] = WORKER_EXTENSION
    additional = kwargs.get("additional_config") or {}
    if not isinstance(additional, dict):
        raise CaptureUnavailable(
            f"additional_config is a {type(additional).__name__}; capture needs a dict to add "
            f"{SITES_CONFIG_KEY!r} to"
        )
    # vLLM keys its compile cache on the configuration, not on the hooks a model
    # class adds: without this key an engine with capture sites could load a graph
    # compiled without them (and the other way round).
    kwargs["additional_config"] = {**additional, SITES_CONFIG_KEY: True}
    return keep_sites_in_graphs(kwargs)


def enable_capture(cli_args) -> None:
    """Switches capture on in parsed engine flags, in place.

    The engine service and every worker node build vLLM's engine arguments from
    their flags; each node's workers need the capture extension (and, where
    graphs replay without Python, the capture op among the graphs' split
    points), so all of them pass through here.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_args = AsyncEngineArgs.from_cli_args(cli_args)
    kwargs = capture_engine_kwargs(
        allow_untested_vllm=cli_args.allow_untested_vllm, **vars(engine_args)
    )
    for key, value in kwargs.items():
        setattr(cli_args, key, value)


def require_prompt_computation(sampling_params, points: list[ExtractionPoint], prompt_tokens: int):
    """Makes vLLM compute every prompt position when a point captures prompt tokens.

    Prompt positions served from the prefix cache never pass through the
    model, so no hook would see them. Returns the (mutated) SamplingParams.
    """
    if needs_prompt_positions(points, prompt_tokens):
        sampling_params.skip_reading_prefix_cache = True
    return sampling_params


class CaptureController:
    """Registers requests on every worker and drains their captured rows.

    Call start() once before the first generate(); it also allocates the
    pipeline buffers later PP stages need on CPU.
    """

    def __init__(self, engine, backlog_bytes: int = DEFAULT_BACKLOG_BYTES) -> None:
        self.engine = engine
        self.backlog_bytes = backlog_bytes
        self._topology: Topology | None = None
        self._vllm_version = ""
        self._registered: set[str] = set()
        # Unregistered since the last drain: their last rows may still be buffered.
        self._ending: set[str] = set()
        self._delivered = DeliveredPositions()
        self._gate = ForwardOrderGate()
        self._request_errors: dict[str, str] = {}
        self._dropped_rows: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._sink: Sink | None = None
        self._rpc_drained = True  # some shipping rank does not push (another host)
        self._barrier: dict[int, int] = {}  # rank -> push sequence every ending row is within
        self._registrations = asyncio.Event()
        self.backlog_rows_dropped = 0  # rows workers dropped past their backlog bound

    async def start(self) -> types_pb.ModelInfo:
        import vllm

        self._vllm_version = vllm.__version__
        vllm_config = getattr(self.engine, "vllm_config", None)
        if vllm_config is not None:
            if vllm_config.parallel_config.worker_extension_cls != WORKER_EXTENSION:
                raise CaptureUnavailable(
                    "the engine was not built with capture_engine_kwargs(): "
                    f"worker_extension_cls is {vllm_config.parallel_config.worker_extension_cls!r}"
                )
            if vllm_config.use_v2_model_runner:
                raise CaptureUnavailable(
                    "the engine uses the V2 model runner, which activation capture does not support"
                )
        try:
            reports = await self.engine.collective_rpc("undercurrent_start")
        except Exception as exc:  # the worker's reason travels in the message
            raise CaptureUnavailable(f"capture could not start on every worker: {exc}") from exc
        self._topology = Topology(tuple(RankTopology.from_dict(r) for r in reports))
        if self._sink is None:
            self._sink = Sink(self.backlog_bytes)
            await self.use_push(True)
        info = self.model_info()
        log.info(
            "capture: %s, %d layers, ranks %s, tensor types %s",
            info.architecture,
            info.num_layers,
            [(r.rank, r.tp_rank, r.pp_rank, r.start_layer, r.end_layer) for r in info.ranks],
            list(self._topology.tensor_types),
        )
        return info

    async def use_push(self, enabled: bool) -> None:
        """Rows by push (the default after start()) or, disabled, by a collective_rpc
        drain per call as before push existed: kept so benchmarks compare the two in
        one run, and as the path for workers on another host."""
        sink = self._sink.address.as_dict() if enabled and self._sink is not None else None
        pushes = await self.engine.collective_rpc("undercurrent_push_to", args=(sink,))
        by_rpc = [
            rank.rank for rank, push in zip(self.topology.ranks, pushes) if rank.ships and not push
        ]
        self._rpc_drained = bool(by_rpc)
        self._barrier = {}
        if enabled and by_rpc:
            log.info(
                "capture: ranks %s run on another node and are drained by collective_rpc", by_rpc
            )

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise FailedPrecondition("capture controller is not started; await start() first")
        return self._topology

    def model_info(self) -> types_pb.ModelInfo:
        return self.topology.model_info(self._vllm_version)

    def validate(self, points: list[ExtractionPoint], prompt_tokens: int | None = None) -> None:
        """Raises InvalidArgument naming the point that this engine cannot serve."""
        self.topology.validate(points)
        if prompt_tokens is not None:
            for i, point in enumerate(points):
                point.tokens.check_prompt_tokens(f'extraction_points[{i}] "{point.name}"', prompt_tokens)

    async def register(self, request_id: str, points: list[ExtractionPoint], prompt_tokens: int) -> None:
        """Validates, then tells every worker; await it before generate()."""
        self.validate(points, prompt_tokens)
        if request_id in self._registered:
            raise FailedPrecondition(f"request {request_id!r} is already registered for capture")
        payload = [p.to_proto().SerializeToString() for p in points]
        await self.engine.collective_rpc(
            "undercurrent_register", args=(request_id, payload, int(prompt_tokens))
        )
        self._registered.add(request_id)
        self._ending.discard(request_id)
        self._registrations.set()
        for point in points:
            layers = point.capture_layers(self.topology.num_layers)
            stages = {r.pp_rank for layer in layers for r in self.topology.owners(layer)}
            if len(stages) > 1:
                self._gate.hold(request_id, point.name, len(layers))

    async def unregister(self, request_id: str) -> None:
        """Stops capture for a request; its last rows arrive with the next drain()."""
        if request_id not in self._registered:
            return
        pushed = await self.engine.collective_rpc("undercurrent_unregister", args=(request_id,))
        for rank, seq in zip(self.topology.ranks, pushed):
            if seq:
                self._barrier[rank.rank] = max(self._barrier.get(rank.rank, 0), seq)
        self._registered.discard(request_id)
        self._ending.add(request_id)
        self._registrations.set()

    async def drain(self) -> list[Block]:
        """Every worker's new rows, merged, exactly once, in (point, layer) blocks.

        Waits up to DRAIN_WAIT_S for rows to arrive (less when a request is
        registered or unregistered meanwhile), and returns the rows of requests
        that ended (unregister) only complete. Costs no worker call when no
        request is registered or ending, or when every shipping worker pushes.
        """
        if not self._registered and not self._ending:
            if self._rpc_drained:
                return []
            self._registrations.clear()
            try:
                await asyncio.wait_for(self._registrations.wait(), DRAIN_WAIT_S)
            except TimeoutError:
                pass
            return []
        ending = set(self._ending)
        shipments = []
        if self._sink is not None:
            if ending:
                barrier, self._barrier = self._barrier, {}
                shipments = await self._sink.receive_until(barrier, BARRIER_TIMEOUT_S)
            else:
                # Cleared with no await since `ending` was read: an unregister from
                # here on ends the wait, and its rows come with the next drain.
                self._registrations.clear()
                shipments = await self._sink.receive(
                    0 if self._rpc_drained else DRAIN_WAIT_S, wake=self._registrations
                )
        if self._rpc_drained:
            shipments += await self.engine.collective_rpc("undercurrent_drain")
        errors = [f"rank {s['rank']}: {e}" for s in shipments for e in s["errors"]]
        for shipment in shipments:
            dropped = Counter()
            for request_id, point, positions in shipment.get("dropped", ()):
                self.backlog_rows_dropped += len(positions)
                self._dropped_rows[(request_id, point)].extend(positions)
                dropped[request_id] += len(positions)
            for request_id, rows in dropped.items():
                self._request_errors.setdefault(
                    request_id,
                    f"capture: rank {shipment['rank']} dropped {rows} rows of this request: the engine "
                    f"service did not take its shipments and they passed the worker's backlog bound "
                    f"({self.backlog_bytes} bytes, --capture-backlog-bytes)",
                )
            for request_id, point, start, stop in shipment["gaps"]:
                self._request_errors.setdefault(
                    request_id,
                    f'point "{point}": positions [{start}, {stop}) were served from the prefix '
                    f"cache and never computed, so they have no activations; register with "
                    f"skip_reading_prefix_cache=True",
                )
        blocks = merge_blocks(decode_parts(p for s in shipments for p in s["parts"]))
        blocks = self._gate.release(self._delivered.filter(blocks), ending)
        self._delivered.forget(ending)
        self._ending -= ending
        if errors:
            raise CaptureUnavailable("capture failed on a worker: " + "; ".join(errors))
        return blocks

    async def check_workers(self, timeout_s: float) -> None:
        """Raises when some worker does not answer within timeout_s (a lost node).

        vLLM watches only the worker processes of its own node; one on another
        node that dies leaves every later step and call waiting for it."""
        await self.engine.collective_rpc("undercurrent_alive", timeout=timeout_s)

    async def local_worker_cores(self) -> set[int]:
        """The cores the workers on this node are bound to (every core they may
        use where vLLM binds none); workers on other nodes do not count."""
        cores: set[int] = set()
        for report in await self.engine.collective_rpc("undercurrent_cores"):
            if report["node"] == node_identity():
                cores.update(report["cores"])
        return cores

    @property
    def recomputed_rows_discarded(self) -> int:
        """Rows discarded because an earlier drain delivered their key (vLLM recomputed
        the position after preempting the request): duplicates, not a loss."""
        return self._delivered.discarded

    def pop_request_errors(self) -> dict[str, str]:
        """Per-request problems found while capturing (record id -> message)."""
        errors, self._request_errors = self._request_errors, {}
        return errors

    def pop_dropped_rows(self) -> dict[tuple[str, str], list[int]]:
        """The positions of rows per (request, point) that workers dropped past
        their backlog bound since the last call (each such request also has an
        error); its finish counts them."""
        dropped, self._dropped_rows = self._dropped_rows, defaultdict(list)
        return dropped
