"""The reference: the same checkpoint in Hugging Face transformers, teacher-forced
over the exact token sequence vLLM computed, with forward hooks on the same modules."""

from __future__ import annotations

import numpy as np

# Worst relative L2 error per row we accept between vLLM's CPU build and
# transformers in float32. Measured errors are about 1e-6; 1e-5 leaves room
# for kernel differences without hiding a wrong row (those are O(1)).
RELATIVE_TOLERANCE = 1e-5


class TransformersOracle:
    def __init__(self, model_path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.num_layers = self.model.config.num_hidden_layers

    def activations(self, token_ids: list[int]) -> dict[tuple[str, int], np.ndarray]:
        """(tensor_type, layer) -> [len(token_ids), hidden] for one sequence."""
        captured: dict[tuple[str, int], np.ndarray] = {}
        handles = []

        def keep(key):
            def hook(module, args, output):
                tensor = output[0] if isinstance(output, tuple) else output
                captured[key] = tensor[0].detach().numpy().copy()

            return hook

        inner = self.model.model
        for i, layer in enumerate(inner.layers):
            handles.append(layer.register_forward_hook(keep(("residual_stream", i))))
            handles.append(layer.self_attn.register_forward_hook(keep(("attn_out", i))))
            handles.append(layer.mlp.register_forward_hook(keep(("mlp_out", i))))
        handles.append(inner.norm.register_forward_hook(keep(("final_norm", self.num_layers))))
        try:
            with self.torch.no_grad():
                self.model(self.torch.tensor([token_ids]))
        finally:
            for handle in handles:
                handle.remove()
        return captured


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))
