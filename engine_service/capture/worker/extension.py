"""The capture extension vLLM mixes into every worker process.

Pass `engine_service.capture.worker.extension.CaptureWorkerExtension` as
`worker_extension_cls`; vLLM appends it to the worker class's bases in each
worker process, and the driver calls its `undercurrent_*` methods through
`collective_rpc`. All mutable state lives in one `_CaptureState` instance per
worker, created by `undercurrent_start`.

Each step, a pre-hook on the model maps the flat batch to capture keys
(`row_mapping.RowMapper`); the capture sites built into the model
(`sites.py`: the decoder layers, `self_attn`, `mlp` and the final norm, kept
by a compiled model too) then hand their tensors to this worker, which gathers
only the selected rows into the step's buffer on the model's device
(`staging.StepStaging`), brought to the host once after the forward pass. vLLM's
norms work in place on the tensors a site sees, so rows are gathered at once
and never referenced later. Only tp_rank 0 of each
pipeline stage receives from its sites: every TP rank holds the same
all-reduced values, so one copy per stage is enough.

Importing this module (vLLM does, in each worker, before it loads the model)
makes vLLM build the supported architectures with their sites.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import numpy as np
import torch

from common.activations import Block, WirePart, encode_part
from common.capture_spec import ExtractionPoint, tensor_type_to_proto
from engine_service.capture.graphs import graphs_skip_sites
from engine_service.capture.worker.pusher import Pusher
from engine_service.capture.channel import node_identity
from engine_service.capture.worker.row_mapping import PointRows, Registration, RowMapper
from engine_service.capture.worker.staging import StepStaging
from engine_service.capture.worker.sites import (
    VERIFIED_ARCHITECTURES,
    has_sites,
    is_stage_placeholder,
    register_models_with_sites,
    set_receiver,
)
from undercurrent.v1 import types_pb2 as types_pb

log = logging.getLogger(__name__)

register_models_with_sites()


class UnsupportedModel(RuntimeError):
    """The model cannot be captured faithfully; the message names what is missing."""


class CaptureWorkerExtension:
    """RPC surface on each worker. Method names carry a prefix so they never
    collide with the worker class's own attributes (vLLM asserts on that)."""

    def undercurrent_start(self) -> dict:
        """Installs hooks once and reports this rank's topology."""
        if getattr(self, "_undercurrent", None) is None:
            self._undercurrent = _CaptureState(self)
        return self._undercurrent.topology

    def undercurrent_push_to(self, sink: dict | None) -> bool:
        """Pushes every step's rows to the driver's sink from now on (None: stops);
        False when this rank does not push: it ships nothing, runs on another
        host, or was told to stop (it is then drained by RPC)."""
        return self._undercurrent.push_to(sink)

    def undercurrent_register(self, request_id: str, points: list[bytes], prompt_tokens: int) -> None:
        parsed = tuple(
            ExtractionPoint.from_proto(types_pb.ExtractionPoint.FromString(p)) for p in points
        )
        self._undercurrent.mapper.register(Registration(request_id, parsed, int(prompt_tokens)))

    def undercurrent_unregister(self, request_id: str) -> int:
        """Stops capturing new rows; rows already buffered go out with the next drain.

        Returns the sequence number of this rank's last push (0: none), which
        every row of the request is at or before."""
        self._undercurrent.mapper.unregister(request_id)
        return self._undercurrent.pushed_seq()

    def undercurrent_drain(self) -> dict:
        return self._undercurrent.drain()

    def undercurrent_alive(self) -> bool:
        """Answers the engine's liveness check: vLLM watches no worker on another node."""
        return True

    def undercurrent_cores(self) -> dict:
        """The node this worker runs on and the cores its compute thread may use
        (on CPU, the ones vLLM bound it to; this RPC runs on that thread)."""
        return {"node": node_identity(), "cores": sorted(os.sched_getaffinity(0))}


class _CaptureState:
    """Everything one worker keeps: registrations, this step's plan, buffers, hooks."""

    def __init__(self, worker) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = worker.model_runner
        if not isinstance(runner, GPUModelRunner):
            raise UnsupportedModel(
                f"model runner {type(runner).__name__} is not vLLM's V1 runner: the V2 "
                f"runner lays out batch rows differently and capture would map them wrongly; "
                f"set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        if runner.speculative_config is not None:
            raise UnsupportedModel(
                "speculative decoding puts draft rows that may be rejected into the batch; "
                "capture refuses it rather than ship activations of rejected tokens"
            )
        vllm_config = worker.vllm_config
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        architecture = model_config.architecture
        if architecture not in VERIFIED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {architecture} is not supported for capture; supported: "
                f"{list(VERIFIED_ARCHITECTURES)}"
            )
        self.runner = runner
        model = runner.get_model()
        decoder = _find(model, "model", architecture)
        layers = _find(decoder, "layers", architecture, "model.")
        start_layer, end_layer = int(decoder.start_layer), int(decoder.end_layer)
        pp_group, tp_group = get_pp_group(), get_tp_group()
        tp_size = parallel.tensor_parallel_size
        num_layers = model_config.get_total_num_hidden_layers()
        has_final_norm = pp_group.is_last_rank
        for i in range(start_layer, end_layer):
            _find(layers[i], "self_attn", architecture, f"model.layers[{i}].")
            _find(layers[i], "mlp", architecture, f"model.layers[{i}].")
        if has_final_norm:
            _find(decoder, "norm", architecture, "model.")
        if not has_sites(model):
            raise UnsupportedModel(
                f"{architecture}: the model was built without capture sites; vLLM must import "
                f"{__name__} (worker_extension_cls) before it loads the model"
            )
        skipped = graphs_skip_sites(vllm_config.compilation_config)
        if skipped:
            raise UnsupportedModel(skipped)

        self.ships = tp_group.rank_in_group == 0
        self.mapper = RowMapper(range(start_layer, end_layer), num_layers, has_final_norm)
        self.staging: StepStaging | None = None  # this step's plan and gathered rows
        # (point, tensor type, layer) -> this drain's chunks: a point's name is its
        # request's own, so two requests may name different tensors alike.
        self.buffers: dict[tuple[str, str, int], list[tuple[PointRows, np.ndarray, str]]] = (
            defaultdict(list)
        )
        self.errors: list[str] = []
        self.sites_ran = False  # whether any site reached this worker in the current step
        self.pusher: Pusher | None = None
        self.pushed_before = 0  # the last sequence number of a closed pusher
        self.topology = dict(
            rank=int(worker.rank),
            tp_rank=int(tp_group.rank_in_group),
            pp_rank=int(pp_group.rank_in_group),
            tp_size=int(tp_size),
            pp_size=int(parallel.pipeline_parallel_size),
            start_layer=start_layer,
            end_layer=end_layer,
            has_final_norm=bool(has_final_norm),
            num_layers=int(num_layers),
            hidden_size=int(model_config.get_hidden_size()),
            vocab_size=int(model_config.get_vocab_size()),
            max_model_len=int(model_config.max_model_len),
            architecture=architecture,
            model=str(model_config.served_model_name or model_config.model),
            dtype=str(model_config.dtype).removeprefix("torch."),
            tensor_types=self._full_tensor_types(layers, start_layer, end_layer, tp_size),
            ships=self.ships,
        )
        self._allocate_pipeline_buffer(pp_group.is_first_rank)
        if self.ships:
            model.register_forward_pre_hook(self._plan_step, with_kwargs=True)
            model.register_forward_hook(self._after_step)
            set_receiver(self._receive)

    @staticmethod
    def _full_tensor_types(layers, start_layer: int, end_layer: int, tp_size: int) -> list[str]:
        """attn_out/mlp_out are full only if their row-parallel layer all-reduces inside
        forward(); a layer built with reduce_results=False leaves a partial sum per rank."""
        types = ["residual_stream"]
        for tensor_type, module, linear in (("attn_out", "self_attn", "o_proj"), ("mlp_out", "mlp", "down_proj")):
            reduced = all(
                getattr(getattr(getattr(layers[i], module), linear, None), "reduce_results", False)
                for i in range(start_layer, end_layer)
            )
            if tp_size == 1 or reduced:
                types.append(tensor_type)
        types.append("final_norm")
        return types

    def _allocate_pipeline_buffer(self, is_first_stage: bool) -> None:
        """With enforce_eager the CPU runner skips the warm-up that allocates the
        buffer later stages receive activations in, and the first step fails in
        sync_and_gather_intermediate_tensors. Allocate it as that warm-up would."""
        runner = self.runner
        if is_first_stage or runner.intermediate_tensors is not None:
            return
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens,
            dtype=runner.model_config.dtype,
            device=runner.device,
        )

    def push_to(self, sink: dict | None) -> bool:
        if sink is None or not self.ships or not Pusher.reaches(sink):
            if self.pusher is not None:
                # What it kept goes to the socket first; ZeroMQ still discards what it has not
                # written when the socket closes (linger 0, so a worker never blocks), so
                # switching push off mid-request (benchmarks, tests) can lose rows.
                self.pusher.flush(for_barrier=True)
                self.pushed_before = self.pusher.seq
                self.pusher.close()
            self.pusher = None
            return False
        if self.pusher is None:
            # Sequence numbers go on from the last pusher's: the driver's barrier
            # compares them with the highest it has read from this rank.
            self.pusher = Pusher(sink, self.topology["rank"], first_seq=self.pushed_before)
        return True

    def pushed_seq(self) -> int:
        if self.pusher is None:
            return 0
        self.pusher.flush(for_barrier=True)  # kept shipments go now: the barrier must not wait for another step
        return self.pusher.seq

    def _plan_step(self, module, args, kwargs) -> None:
        self.sites_ran = False
        if not self.mapper.registrations:
            self.staging = None
            return
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        query_start_loc = self.runner.query_start_loc.np[: num_reqs + 1]
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        num_rows = int(query_start_loc[-1]) if num_reqs else 0
        plan = self.mapper.plan(
            batch.req_ids[:num_reqs],
            query_start_loc,
            positions[:num_rows].cpu().numpy(),
        )
        self.staging = StepStaging(plan, self.runner.device)

    def _after_step(self, module, args, output) -> None:
        """After this stage's forward pass: everything it captured goes to the driver.

        A planned step whose sites never ran is a model compiled without them (a
        compile cache of the same model built elsewhere without sites, say): that
        is an error on every request it touches, never an empty capture."""
        staging, self.staging = self.staging, None
        if staging is not None and staging.plan and not self.sites_ran:
            self._fail(
                "the model's capture sites did not run in this step's forward pass: it was "
                "compiled without them; restart the engine with --enforce-eager, or after "
                "clearing vLLM's compile cache (torch_compile_cache under $VLLM_CACHE_ROOT, "
                "~/.cache/vllm by default)"
            )
        if staging is not None:
            for point_rows, array, dtype in staging.collect():
                key = (point_rows.point, point_rows.tensor_type, point_rows.layer)
                self.buffers[key].append((point_rows, array, dtype))
        if self.pusher is not None and (self.buffers or self.errors or self.mapper.gaps):
            self.pusher.push(self.drain(copy=False))

    def _receive(self, tensor_type: str, layer: int, tensor: torch.Tensor, addend: torch.Tensor | None) -> None:
        """One site's tensor this step (residual_stream: hidden states and residual)."""
        self.sites_ran = True
        planned = self.staging.plan.get((tensor_type, layer)) if self.staging is not None else None
        if not planned:
            return
        if tensor_type == "residual_stream":
            if addend is None or tensor.shape != addend.shape:
                self._fail(
                    f"layer {layer}: decoder layer returned hidden_states "
                    f"{tuple(tensor.shape)} and residual "
                    f"{None if addend is None else tuple(addend.shape)}; refusing to sum them"
                )
                return
            for staged in planned:
                self.staging.gather(staged, tensor, addend)
            return
        for staged in planned:
            self.staging.gather(staged, tensor)

    def _fail(self, message: str) -> None:
        if message not in self.errors:
            log.error("capture: %s", message)
            self.errors.append(message)

    def drain(self, copy: bool = True) -> dict:
        """Everything buffered since the last drain, as plain values and bytes; with
        copy=False the rows are views of the step's buffer (the push sends it as it is)."""
        parts: list[WirePart] = []
        for (point, tensor_type, layer), chunks in self.buffers.items():
            planned = [c[0] for c in chunks]
            parts.append(
                encode_part(
                    Block(
                        point=point,
                        tensor_type=tensor_type_to_proto(tensor_type),
                        layer=layer,
                        rows=_end_to_end([c[1] for c in chunks]),
                        request_ids=[r for p in planned for r in p.request_ids],
                        token_positions=_end_to_end([p.positions for p in planned]),
                        is_generated=_end_to_end([p.is_generated for p in planned]),
                        wire_dtype=chunks[0][2],
                    ),
                    copy=copy,
                )
            )
        self.buffers.clear()
        gaps = [(g.request_id, g.point, g.start, g.stop) for g in self.mapper.take_gaps()]
        errors, self.errors = self.errors, []
        return {"rank": self.topology["rank"], "parts": parts, "gaps": gaps, "errors": errors}


def _end_to_end(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays joined; the one array itself when there is one (a worker that
    pushes drains every step, one chunk per point and layer), as encoding copies it anyway."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _find(module, name: str, architecture: str, path: str = ""):
    """A required submodule, or UnsupportedModel naming the path that is missing."""
    child = getattr(module, name, None)
    if child is None or is_stage_placeholder(child):
        raise UnsupportedModel(
            f"{architecture}: module {path}{name} not found; capture needs Llama/Qwen3 "
            f"naming (model.layers[i].self_attn, model.layers[i].mlp, model.norm)"
        )
    return child
