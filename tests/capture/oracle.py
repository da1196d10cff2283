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


def compare_with_oracle(oracle: TransformersOracle, run, requests) -> dict[str, float]:
    """Checks every captured row against the oracle; returns the worst error per tensor type.

    Each request's reference sequence is its prompt plus every generated token
    but the last, which is sampled and never fed through the model.
    """
    records = run.records()
    worst: dict[str, float] = {}
    checked = set()
    for request in requests:
        for record_id, tokens in run.tokens.items():
            if record_id != request.request_id and not record_id.endswith(f"_{request.request_id}"):
                continue
            sequence = request.prompt_token_ids + tokens[:-1]
            reference = oracle.activations(sequence)
            for key, row in records.items():
                rid, point, layer, position = key
                if rid != record_id:
                    continue
                tensor_type = next(p.tensor_type for p in request.points if p.name == point)
                expected = reference[(tensor_type, layer)][position]
                error = relative_error(row, expected)
                assert error < RELATIVE_TOLERANCE, (
                    f"{key}: relative L2 error {error:.2e} >= {RELATIVE_TOLERANCE:.0e}"
                )
                worst[tensor_type] = max(worst.get(tensor_type, 0.0), error)
                checked.add(key)
    assert checked == set(records), f"records of unknown requests: {set(records) - checked}"
    return worst


# Records per captured position of `workloads.every_tensor_type()`: residual, attn
# and mlp on 4 layers, and the final norm.
RECORDS_PER_POSITION = 4 * 3 + 1


def check_every_position(oracle: TransformersOracle, run, requests) -> dict[str, float]:
    """Checks a run of `workloads.every_position` against the oracle and checks that
    every request has all its records: every position it computed (the last sampled
    token is never fed through the model, so it has none), each tensor type, and the
    first generated position marked generated. Returns the worst error per type."""
    worst = compare_with_oracle(oracle, run, requests)
    assert set(worst) == {"residual_stream", "attn_out", "mlp_out", "final_norm"}
    records = run.records()
    for request in requests:
        positions = len(request.prompt_token_ids) + request.max_tokens - 1
        captured = {k for k in records if k[0] == request.request_id}
        assert len(captured) == positions * RECORDS_PER_POSITION
        assert {k[3] for k in captured} == set(range(positions))
        generated = [
            b.is_generated[i]
            for b in run.blocks
            for i in range(b.num_rows)
            if b.request_ids[i] == request.request_id
            and b.token_positions[i] == len(request.prompt_token_ids)
        ]
        assert generated and all(generated)
    return worst
