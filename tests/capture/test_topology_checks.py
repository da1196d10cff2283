"""Request-time checks against the ranks' reported topology, and start-up refusals."""

import pytest

from common.capture_spec import ExtractionPoint
from common.errors import InvalidArgument
from engine_service.capture.driver.controller import (
    ALLOW_UNTESTED_VLLM_ENV,
    CaptureUnavailable,
    SITES_CONFIG_KEY,
    WORKER_EXTENSION,
    capture_engine_kwargs,
    check_vllm_version,
)
from engine_service.capture.driver.topology import RankTopology, Topology
from undercurrent.v1 import types_pb2 as types_pb

ALL_TYPES = ("residual_stream", "attn_out", "mlp_out", "final_norm")


def rank(rank, pp_rank, start, end, last, tensor_types=ALL_TYPES, tp_rank=0, tp_size=1, pp_size=2):
    return RankTopology(
        rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, tp_size=tp_size, pp_size=pp_size,
        start_layer=start, end_layer=end, has_final_norm=last, num_layers=4, hidden_size=128,
        vocab_size=512, max_model_len=256, architecture="LlamaForCausalLM", model="m",
        dtype="float32", tensor_types=tensor_types, ships=tp_rank == 0,
    )


def error_of(topology, *points) -> str:
    with pytest.raises(InvalidArgument) as info:
        topology.validate(list(points))
    return str(info.value)


def test_layer_no_rank_owns_is_a_configuration_error():
    # A partition that leaves layer 2 to nobody (vLLM never builds this, but a
    # rank report is what validation trusts).
    topology = Topology((rank(0, 0, 0, 2, False), rank(1, 1, 3, 4, True)))
    message = error_of(topology, ExtractionPoint("ok", "residual_stream", (0, 3)), ExtractionPoint("mid", "mlp_out", (1, 2)))
    assert message == (
        'extraction_points[1] "mid": layers[1]=2 is owned by no rank (rank 0: [0, 2), rank 1: [3, 4))'
    )


def test_tensor_type_without_full_tensor_under_tp_is_refused():
    partial = ("residual_stream", "mlp_out", "final_norm")  # o_proj built with reduce_results=False
    topology = Topology(
        (rank(0, 0, 0, 4, True, partial, 0, 2, 1), rank(1, 0, 0, 4, True, partial, 1, 2, 1))
    )
    assert topology.tensor_types == partial
    assert error_of(topology, ExtractionPoint("attn", "attn_out", (1,))) == (
        'extraction_points[0] "attn": tensor_type attn_out is not available on this engine '
        "(LlamaForCausalLM, tensor_parallel_size=2): a row-parallel layer is built with "
        "reduce_results=False, so no hook sees the full tensor; available: "
        "['residual_stream', 'mlp_out', 'final_norm']"
    )


def test_model_info_fills_every_field():
    topology = Topology((rank(0, 0, 0, 2, False), rank(1, 1, 2, 4, True)))
    info = topology.model_info("0.32.0")
    assert [f.name for f in types_pb.ModelInfo.DESCRIPTOR.fields if not getattr(info, f.name)] == []
    assert [(r.rank, r.pp_rank, r.start_layer, r.end_layer, r.has_final_norm) for r in info.ranks] == [
        (0, 0, 0, 2, False), (1, 1, 2, 4, True)
    ]
    assert list(info.tensor_types) == [types_pb.TENSOR_TYPE_RESIDUAL_STREAM, types_pb.TENSOR_TYPE_ATTN_OUT, types_pb.TENSOR_TYPE_MLP_OUT, types_pb.TENSOR_TYPE_FINAL_NORM]
    assert (info.pipeline_parallel_size, info.num_layers, info.vllm_version) == (2, 4, "0.32.0")


def test_engine_kwargs_switch_capture_on_and_keep_compilation_where_sites_run():
    kwargs = capture_engine_kwargs(model="m", enforce_eager=False, tensor_parallel_size=2)
    assert kwargs == {
        "model": "m",
        "tensor_parallel_size": 2,
        "enforce_eager": False,  # this host is CPU: compiled models run the sites (test_graphs.py)
        "worker_extension_cls": WORKER_EXTENSION,
        # Part of vLLM's compile cache key: a graph compiled without sites is never loaded.
        "additional_config": {SITES_CONFIG_KEY: True},
    }
    assert capture_engine_kwargs(model="m", enforce_eager=True)["enforce_eager"] is True
    user = capture_engine_kwargs(model="m", additional_config={"x": 1})["additional_config"]
    assert user == {"x": 1, SITES_CONFIG_KEY: True}
    with pytest.raises(CaptureUnavailable, match="additional_config is a list; capture needs a dict"):
        capture_engine_kwargs(model="m", additional_config=[1])


def test_capture_sites_change_vllms_compile_cache_key():
    from vllm.config import VllmConfig

    assert VllmConfig(additional_config={SITES_CONFIG_KEY: True}).compute_hash() != VllmConfig().compute_hash()


def test_engine_kwargs_refuse_what_would_capture_wrong_rows(monkeypatch):
    with pytest.raises(CaptureUnavailable, match="speculative decoding is not supported"):
        capture_engine_kwargs(model="m", speculative_config={"method": "ngram"})
    with pytest.raises(CaptureUnavailable, match="worker_extension_cls is already set to 'x.Y'"):
        capture_engine_kwargs(model="m", worker_extension_cls="x.Y")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(CaptureUnavailable, match="V2 model runner"):
        capture_engine_kwargs(model="m")


def test_version_check_names_supported_versions_and_honours_the_override(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_VLLM_ENV, raising=False)
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.1+cpu") == "0.32.1+cpu"
    with pytest.raises(CaptureUnavailable) as info:
        check_vllm_version("0.33.0")
    assert str(info.value) == (
        "vLLM 0.33.0 is not supported for activation capture; supported versions: 0.32.x. "
        f"Set {ALLOW_UNTESTED_VLLM_ENV}=1 to run anyway."
    )
    assert check_vllm_version("0.33.0", allow_untested=True) == "0.33.0"
    monkeypatch.setenv(ALLOW_UNTESTED_VLLM_ENV, "1")
    assert check_vllm_version("0.33.0") == "0.33.0"


def test_module_discovery_names_the_missing_module():
    from torch import nn

    from engine_service.capture.worker.extension import UnsupportedModel, _find

    gpt2_like = nn.Module()
    gpt2_like.transformer = nn.Module()
    with pytest.raises(UnsupportedModel) as info:
        _find(gpt2_like, "model", "GPT2LMHeadModel")
    assert str(info.value) == (
        "GPT2LMHeadModel: module model not found; capture needs Llama/Qwen3 naming "
        "(model.layers[i].self_attn, model.layers[i].mlp, model.norm)"
    )
