"""Capture sites: the places in a model's forward pass where activations are taken.

Sites are built into a model when vLLM constructs it, before vLLM compiles it, so
a compiled model keeps them: forward hooks registered later never fire under
compilation, because vLLM traces the model once and from then on runs the
compiled graph, which calls no module. Each site is a forward hook on a decoder layer, its `self_attn`, its `mlp`
or the final norm. While Dynamo traces the model, the hook emits the custom op
`undercurrent::capture` into the graph (opaque, so it runs at every step with the
tensor of that moment); in eager mode the hook calls the same receiver directly.
Either way the receiver is whatever the worker's capture state installed with
`set_receiver`, or nothing: until capture starts, and on ranks that ship
nothing, a site costs one Python call per step.

The custom op runs Python, so a graph that replays without Python (CUDA graphs)
would skip it; wherever vLLM captures such graphs, `graphs.keep_sites_in_graphs`
makes the op one of the points vLLM splits its graphs at, so it runs between
them.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from common.capture_spec import TENSOR_TYPES

# (tensor type, layer, tensor, addend or None); residual_stream's addend is the
# residual the decoder layer returns beside its hidden states.
Receiver = Callable[[str, int, torch.Tensor, "torch.Tensor | None"], None]

_receiver: Receiver | None = None

# The custom op every site emits into a compiled graph, by the name vLLM's
# `splitting_ops` use.
SITE_OP = "undercurrent::capture"

# Architectures whose module layout and residual semantics were checked against
# transformers (tests/capture/test_oracle.py), and the vLLM module defining each.
VERIFIED_ARCHITECTURES = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}

# The op declares that it writes this tensor (it never does): Inductor removes an
# op with no output and no mutation as dead code.
_KEEP_ALIVE = torch.zeros(1)

# The attribute that marks a model whose sites are installed.
_INSTALLED = "_undercurrent_capture_sites"


def set_receiver(receiver: Receiver | None) -> None:
    """Routes every site of this process to `receiver` (None: sites do nothing)."""
    global _receiver
    _receiver = receiver


def _capture_op(
    tensor: torch.Tensor,
    addend: torch.Tensor | None,
    tensor_type: int,
    layer: int,
    keep_alive: torch.Tensor,
) -> None:
    if _receiver is not None:
        _receiver(TENSOR_TYPES[tensor_type], layer, tensor, addend)


# Defined on a torch.library.Library with a kernel per device, as vLLM registers
# its own ops, rather than with torch.library.custom_op: for an op that mutates an
# argument, custom_op adds a Python kernel on the ADInplaceOrView key that rebuilds
# the schema's argument list several times per call: 17-25 µs per site and step in
# a worker, against 2-5 µs here, where that key falls through (measured by `python -m bench.site_op`).
_LIBRARY = torch.library.Library(SITE_OP.partition("::")[0], "FRAGMENT")
_LIBRARY.define(
    "capture(Tensor tensor, Tensor? addend, int tensor_type, int layer, Tensor(a!) keep_alive) -> ()")
for _device in ("CPU", "CUDA"):  # the devices vLLM runs models on here
    _LIBRARY.impl("capture", _capture_op, _device)
torch.library.register_fake(SITE_OP, lambda tensor, addend, tensor_type, layer, keep_alive: None, lib=_LIBRARY)


def _site(tensor_type: str, layer: int, tensor: torch.Tensor, addend: torch.Tensor | None) -> None:
    if torch.compiler.is_compiling():
        torch.ops.undercurrent.capture(tensor, addend, TENSOR_TYPES.index(tensor_type), layer, _KEEP_ALIVE)
    elif _receiver is not None:
        _receiver(tensor_type, layer, tensor, addend)


def _decoder_layer_site(layer: int):
    def hook(module, args, output) -> None:
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        _site("residual_stream", layer, hidden, residual)

    return hook


def _output_site(tensor_type: str, layer: int):
    def hook(module, args, output) -> None:
        _site(tensor_type, layer, output[0] if isinstance(output, tuple) else output, None)

    return hook


def install_sites(model: torch.nn.Module, num_layers: int) -> None:
    """Hooks every site of a Llama-layout causal LM (`model.layers[i].self_attn`,
    `.mlp`, `model.norm`) on the layers this pipeline stage holds; the final
    norm's site counts as layer `num_layers`."""
    decoder = model.model
    for i in range(decoder.start_layer, decoder.end_layer):
        layer = decoder.layers[i]
        layer.register_forward_hook(_decoder_layer_site(i))
        layer.self_attn.register_forward_hook(_output_site("attn_out", i))
        layer.mlp.register_forward_hook(_output_site("mlp_out", i))
    if not is_stage_placeholder(decoder.norm):
        decoder.norm.register_forward_hook(_output_site("final_norm", num_layers))
    setattr(model, _INSTALLED, True)


def is_stage_placeholder(module: torch.nn.Module) -> bool:
    """vLLM's stand-in for a module another pipeline stage holds."""
    return type(module).__name__ == "PPMissingLayer"


def has_sites(model: torch.nn.Module) -> bool:
    return getattr(model, _INSTALLED, False)


def _with_sites(base: type) -> type:
    """`base` with its sites installed at construction."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        install_sites(self, vllm_config.model_config.get_total_num_hidden_layers())

    return type(f"Captured{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})


def register_models_with_sites() -> None:
    """Makes vLLM build the supported architectures with their sites, in this process.

    Called when vLLM imports the worker extension, which it does in each worker
    before loading the model."""
    from vllm import ModelRegistry

    for architecture, module in VERIFIED_ARCHITECTURES.items():
        base = getattr(importlib.import_module(module), architecture)
        ModelRegistry.register_model(architecture, _with_sites(base))
