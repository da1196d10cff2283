"""Starting real AsyncLLM engines with capture, and running requests through the
controller exactly as the engine service does: register, generate, drain after
steps, unregister."""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import numpy as np

from common import tensor_codec
from common.activations import Block, forward_order
from common.capture_spec import ExtractionPoint
from engine_service.capture.driver.controller import (
    CaptureController,
    capture_engine_kwargs,
    require_prompt_computation,
)
from undercurrent.v1 import engine_pb2 as engine_pb


@asynccontextmanager
async def capture_engine(model: str, tp: int = 1, pp: int = 1, stat_loggers=None, allowances=None,
                         **engine_kwargs):
    """An AsyncLLM with capture started; shut down on exit. With `allowances` (an
    AllowancePublisher), its scheduler holds requests bounded by --max-tokens-ahead."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine_service.engine_core.tokens_ahead import ADDRESS_ENV, SCHEDULER_CLS

    workers = tp * pp
    if workers > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(workers))
    defaults = dict(dtype="float32", max_model_len=256, seed=0)
    if allowances is not None:
        os.environ[ADDRESS_ENV] = allowances.address
        defaults["scheduler_cls"] = SCHEDULER_CLS
    kwargs = capture_engine_kwargs(
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **{**defaults, **engine_kwargs},
    )
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=stat_loggers)
    try:
        controller = CaptureController(engine)
        await controller.start()
        yield engine, controller
    finally:
        engine.shutdown()
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


# What vLLM's piecewise backend needs on a CPU, where it never runs otherwise: no
# CUDA graphs, pieces run by the eager backend (vLLM's Inductor passes name
# CUDA-only kernels), no compile sizes, no fusion passes (CUDA-only).
_CPU_PIECEWISE = {
    "cudagraph_mode": "NONE",
    "backend": "eager",
    "compile_sizes": [],
    "pass_config": {
        name: False
        for name in ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "fuse_allreduce_rms",
                     "enable_qk_norm_rope_fusion", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache",
                     "fuse_rope_kvcache_cat_mla")
    },
}


@contextmanager
def vllm_piecewise_on_cpu():
    """The compilation config (a dict) of vLLM's piecewise mode, as a GPU runs it
    without its CUDA graphs, for engines configured in this process meanwhile:
    vLLM's CPU platform would turn piecewise compilation into one Dynamo trace."""
    from vllm.config import CompilationMode
    from vllm.platforms.cpu import CpuPlatform

    configure = CpuPlatform.__dict__["check_and_update_config"]

    def keep_piecewise(cls, vllm_config) -> None:
        compilation = vllm_config.compilation_config
        mode, backend = compilation.mode, compilation.backend
        configure.__func__(cls, vllm_config)
        if mode == CompilationMode.VLLM_COMPILE:
            compilation.mode, compilation.backend = mode, backend

    CpuPlatform.check_and_update_config = classmethod(keep_piecewise)
    try:
        yield {**_CPU_PIECEWISE, "mode": CompilationMode.VLLM_COMPILE}
    finally:
        CpuPlatform.check_and_update_config = configure


def split_points(worker) -> tuple[str, int]:
    """Sent to each worker by `collective_rpc` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
    when the engine starts): the worker's compilation mode, and how many of its
    model's pieces are split points, run eagerly between the pieces CUDA graphs
    would replay."""
    from vllm.compilation.counter import compilation_counter as counter

    split = counter.num_piecewise_graphs_seen - counter.num_piecewise_capturable_graphs_seen
    return worker.vllm_config.compilation_config.mode.name, split


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    points: list[ExtractionPoint]
    max_tokens: int = 6
    n: int = 1  # n > 1 samples (temperature 1, seeded); records carry "<index>_<id>"
    compute_prompt: bool = True  # False: leave prefix caching on (a misconfigured engine)

    def generate_request(self) -> engine_pb.GenerateRequest:
        """The same greedy request for an engine service, every point streamed to the client."""
        points = [p.to_proto() for p in self.points]
        for point in points:
            point.stream_to_client = True
        return engine_pb.GenerateRequest(
            request_id=self.request_id, token_ids=engine_pb.TokenIds(ids=self.prompt_token_ids),
            sampling=engine_pb.SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True),
            extraction_points=points)


@dataclass
class CaptureRun:
    """What a run produced: tokens per request and every record, in arrival order."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)
    drains: list[list[Block]] = field(default_factory=list)  # non-empty drains, in order

    def records(self) -> dict[tuple, np.ndarray]:
        """Key (request, point, layer, position) -> row as float32 (a bfloat16 block
        keeps its rows as bits); asserts each key arrives once."""
        out: dict[tuple, np.ndarray] = {}
        for block in self.blocks:
            dtype = tensor_codec.wire_dtype_of(block.rows, block.wire_dtype)
            rows = tensor_codec.to_float32(block.rows, dtype)
            for i in range(block.num_rows):
                key = (block.request_ids[i], block.point, block.layer, int(block.token_positions[i]))
                assert key not in out, f"key {key} delivered twice"
                out[key] = rows[i]
        return out

    def arrival_order(self, request_id: str, point: str) -> list[tuple[int, int]]:
        """(position, layer) of one point's records in the order a probe reads them:
        drain by drain, each drain in forward order."""
        return [
            (r.token_position, r.layer)
            for drain in self.drains
            for r in forward_order(drain)
            if r.request_id == request_id and r.point == point
        ]


async def run_requests(engine, controller: CaptureController, requests: list[Request]) -> CaptureRun:
    """Runs requests concurrently (greedy) while draining after steps, like the engine."""
    from vllm import SamplingParams

    run = CaptureRun()
    running = len(requests)

    async def one(req: Request) -> None:
        nonlocal running
        params = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=0.0 if req.n == 1 else 1.0,
            n=req.n,
            seed=None if req.n == 1 else 7,
            ignore_eos=True,
        )
        if req.compute_prompt:
            require_prompt_computation(params, req.points, len(req.prompt_token_ids))
        await controller.register(req.request_id, req.points, len(req.prompt_token_ids))
        try:
            async for out in engine.generate(
                {"prompt_token_ids": req.prompt_token_ids}, params, req.request_id
            ):
                for sample in out.outputs:
                    record_id = req.request_id if req.n == 1 else f"{sample.index}_{req.request_id}"
                    run.tokens[record_id] = list(sample.token_ids)
        finally:
            await controller.unregister(req.request_id)
            running -= 1

    async def drain_once() -> None:
        blocks = await controller.drain()
        if blocks:
            run.drains.append(blocks)
            run.blocks.extend(blocks)

    async def drain_loop() -> None:
        while running:
            await asyncio.sleep(0.002)
            await drain_once()
        await drain_once()

    await asyncio.gather(drain_loop(), *(one(r) for r in requests))
    return run
