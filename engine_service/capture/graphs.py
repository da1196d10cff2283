"""Capture under vLLM's graphs: the capture op as a graph split point.

A replayed CUDA graph runs the kernels it recorded and no Python, so a capture
site inside one would run once, while the graph is captured, and never again.
vLLM already has a place for ops that must run at every step outside its graphs:
its piecewise mode splits the compiled model at `splitting_ops` (attention, by
default), records a CUDA graph for each piece between them and runs the split
ops themselves eagerly between the pieces. Adding the capture op to those ops
keeps every site running while the rest of the model replays as graphs; full
graphs (one graph for the whole forward pass, vLLM's default for decode
batches) would skip the sites, so capture asks for piecewise graphs only.

This runs where vLLM replays graphs (GPU). On CPU vLLM compiles without graph
replay and the sites run as they are (`sites.py`); the piecewise split itself is
tested on CPU through vLLM's own piecewise backend (`tests/capture/test_graphs.py`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from engine_service.capture import CaptureUnavailable
from engine_service.capture.worker.sites import SITE_OP

log = logging.getLogger(__name__)


def graphs_replay_without_python(platform=None) -> bool:
    """Whether vLLM's default mode on this platform replays captured graphs (CUDA
    graphs on GPU) that would skip the capture sites' Python.

    On CPU vLLM compiles the model with Dynamo and Inductor and captures no
    graphs: the compiled model keeps the sites (`sites.py`) and runs them every
    step, so capture runs at vLLM's default speed."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    return not platform.is_cpu()


def keep_sites_in_graphs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments whose graphs run every capture site.

    Where graphs replay without Python (and the user did not ask for eager), the
    capture op joins vLLM's split points and CUDA graphs are piecewise. A user's
    own `splitting_ops` are kept; a user's request for full graphs is refused,
    since it cannot be honoured with capture on. Where vLLM's configuration has
    no split points at all (its attention-quantisation fusion wants full graphs),
    the engine runs eager, as it says in the log."""
    from vllm.config import CompilationConfig, CUDAGraphMode

    if kwargs.get("enforce_eager") or not graphs_replay_without_python():
        return kwargs
    config = kwargs.get("compilation_config")
    if config is None:
        config = CompilationConfig()
    elif isinstance(config, dict):
        config = CompilationConfig(**config)
    else:
        config = copy.deepcopy(config)  # the caller's stays as it was
    if config.cudagraph_mode is not None and config.cudagraph_mode.has_full_cudagraphs():
        raise CaptureUnavailable(
            f"compilation_config.cudagraph_mode={config.cudagraph_mode.name} replays full CUDA "
            f"graphs, which skip the capture sites; capture needs PIECEWISE or NONE (or "
            f"--enforce-eager)"
        )
    split_points = _split_points(config)
    if not split_points:
        log.info(
            "capture: setting enforce_eager=True: vLLM's configuration splits its graphs "
            "nowhere (full CUDA graphs only), and capture sites run Python at every step"
        )
        return {**kwargs, "enforce_eager": True}
    config.splitting_ops = [*split_points, SITE_OP]
    if config.cudagraph_mode is None:
        config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    log.info(
        "capture: %s is a graph split point: CUDA graphs are %s, and every capture site "
        "runs between them", SITE_OP, config.cudagraph_mode.name,
    )
    return {**kwargs, "compilation_config": config}


def _split_points(config) -> list[str]:
    """The ops vLLM splits this configuration's graphs at, as it would choose them:
    the user's, or vLLM's defaults for piecewise compilation."""
    from vllm.config import CompilationMode

    if config.splitting_ops is not None:
        return [op for op in config.splitting_ops if op != SITE_OP]
    probe = copy.deepcopy(config)
    probe.mode = CompilationMode.VLLM_COMPILE
    probe.set_splitting_ops_for_v1(all2all_backend="")
    return list(probe.splitting_ops or ())


def graphs_skip_sites(compilation_config) -> str | None:
    """Why the graphs vLLM settled on would skip the capture sites, or None.

    vLLM may still change the graph mode after the engine arguments (a platform,
    an attention backend or a parallel layout can override it), so each worker
    checks the configuration it actually runs."""
    from vllm.config import CUDAGraphMode

    mode = compilation_config.cudagraph_mode or CUDAGraphMode.NONE
    if mode.has_full_cudagraphs():
        return (
            f"vLLM runs full CUDA graphs (cudagraph_mode={mode.name}), which replay the forward "
            f"pass without the capture sites; run with --enforce-eager or "
            f"-cc.cudagraph_mode=PIECEWISE"
        )
    if mode.has_piecewise_cudagraphs() and SITE_OP not in (compilation_config.splitting_ops or ()):
        return (
            f"vLLM runs piecewise CUDA graphs without {SITE_OP} among its splitting_ops, so "
            f"the capture sites inside its graphs would not run when they replay; run with "
            f"--enforce-eager"
        )
    return None
