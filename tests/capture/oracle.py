"""The reference: the same checkpoint in Hugging Face transformers, in the dtype the
engine serves, teacher-forced over the exact token sequence vLLM computed, with
forward hooks on the same modules."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Worst relative L2 error per row we accept between vLLM's CPU build and
# transformers in float32. Measured errors are about 1e-6; 1e-5 leaves room
# for kernel differences without hiding a wrong row (those are O(1)).
RELATIVE_TOLERANCE = 1e-5

# Half precision. The unit roundoff u bounds the relative error of one rounding:
# 2^-8 for bfloat16 (8 significant bits), 2^-11 for float16 (11). vLLM and
# transformers both round every intermediate to the dtype, but in different
# places (fused kernels, float32 accumulation inside matmuls and norms, the
# residual adds), so the same row differs by roundings compounded over the
# operations behind it. Measured on the 4-layer model (vLLM 0.32 CPU build,
# compiled), every tensor type, both dtypes, TP=1, TP=2 and PP=2: 3.0u to 9.4u
# through the engine service, up to 10u in the engine's process with prompts of
# 45 tokens; the MLP output is always the largest. 16u leaves 1.6x room above
# that and stays above 1.4x under the nearest wrong capture measured, 23u: the
# attention output of the position before, in bfloat16 (attention at
# neighbouring positions averages nearly the same values; fewer than 24 tokens
# of context here, 24u after 45). tests/processes/test_half_precision.py shows
# that each capture of `wrong_captures` fails it.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
HALF_PRECISION_GROWTH = 16


def relative_tolerance(dtype: str) -> float:
    """The worst relative L2 error per row accepted for an engine serving `dtype`."""
    if dtype == "float32":
        return RELATIVE_TOLERANCE
    return HALF_PRECISION_GROWTH * UNIT_ROUNDOFF[dtype]


# vLLM's row-parallel projections (o_proj, down_proj) under TP: each rank
# multiplies its slice of the input columns, and an all-reduce sums the slices.
ROW_PARALLEL = {"attn_out": ("self_attn", "o_proj"), "mlp_out": ("mlp", "down_proj")}
SHARD_TP = 2


@dataclass
class Reference:
    """One sequence through transformers, every value widened exactly to float32."""

    token_ids: list[int]
    activations: dict[tuple[str, int], np.ndarray]  # (tensor_type, layer) -> [tokens, hidden]
    logits: np.ndarray  # [tokens, vocab]: row i predicts token i + 1
    # (tensor_type, layer) -> [tokens, hidden]: what TP rank 0 of SHARD_TP adds to
    # attn_out and mlp_out before the all-reduce (its slice of the row-parallel sum).
    rank0_shards: dict[tuple[str, int], np.ndarray]


@dataclass(frozen=True)
class GreedyStep:
    """One generated token against the reference's logits at the position before it."""

    position: int  # the position whose logits chose the token
    token: int  # vLLM's
    reference_token: int  # the reference's top logit
    tie: bool  # another token is within rounding of the top one


class TransformersOracle:
    def __init__(self, model_path: str, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation="eager"
        ).eval()
        self.num_layers = self.model.config.num_hidden_layers
        self.unembedding = self.model.lm_head.weight.detach().float().numpy()

    @property
    def tolerance(self) -> float:
        return relative_tolerance(self.dtype)

    def reference(self, token_ids: list[int]) -> Reference:
        torch = self.torch
        captured: dict[tuple[str, int], np.ndarray] = {}
        shards: dict[tuple[str, int], np.ndarray] = {}
        handles = []

        def widened(tensor) -> np.ndarray:
            return tensor[0].detach().float().numpy().copy()

        def keep(key):
            def hook(module, args, output):
                captured[key] = widened(output[0] if isinstance(output, tuple) else output)

            return hook

        def keep_rank0_shard(key):
            def hook(module, args):
                columns = module.weight.shape[1] // SHARD_TP
                shard = torch.nn.functional.linear(args[0][..., :columns], module.weight[:, :columns])
                shards[key] = widened(shard)

            return hook

        inner = self.model.model
        for i, layer in enumerate(inner.layers):
            handles.append(layer.register_forward_hook(keep(("residual_stream", i))))
            handles.append(layer.self_attn.register_forward_hook(keep(("attn_out", i))))
            handles.append(layer.mlp.register_forward_hook(keep(("mlp_out", i))))
            for tensor_type, (block, projection) in ROW_PARALLEL.items():
                module = getattr(getattr(layer, block), projection)
                handles.append(module.register_forward_pre_hook(keep_rank0_shard((tensor_type, i))))
        handles.append(inner.norm.register_forward_hook(keep(("final_norm", self.num_layers))))
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([token_ids])).logits
        finally:
            for handle in handles:
                handle.remove()
        return Reference(list(token_ids), captured, widened(logits), shards)

    def greedy_steps(self, reference: Reference, final_norm: dict[int, np.ndarray], prompt_tokens: int,
                     tokens: list[int]) -> list[GreedyStep]:
        """vLLM's greedy tokens against the reference's top logits. `final_norm`
        holds vLLM's final-norm row of each position that chose a token.

        A step is a tie when some token c could overtake the reference's top token
        a in vLLM's logits: when the gap l_a - l_c is within what the two final-norm
        rows' difference d moves it, |(w_a - w_c) . d| (w: rows of the unembedding),
        plus one rounding of each of the two logits in each computation,
        2u(|l_a| + |l_c|)."""
        u = UNIT_ROUNDOFF[self.dtype]
        steps = []
        for index, token in enumerate(tokens):
            position = prompt_tokens - 1 + index
            logits = reference.logits[position]
            top = int(np.argmax(logits))
            moved = final_norm[position] - reference.activations[("final_norm", self.num_layers)][position]
            reach = (np.abs((self.unembedding[top] - self.unembedding) @ moved)
                     + 2 * u * (abs(logits[top]) + np.abs(logits)))
            gaps = logits[top] - logits
            gaps[top] = np.inf
            steps.append(GreedyStep(position, token, top, bool((gaps <= reach).any())))
        return steps


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))


def references(oracle: TransformersOracle, run, requests) -> dict[str, tuple]:
    """Record id -> (its request, its Reference), for every record id of the run
    (a request, or each child of an n>1 request).

    Each reference sequence is the prompt plus every generated token but the last,
    which is sampled and never fed through the model.
    """
    out = {}
    for request in requests:
        for record_id, tokens in run.tokens.items():
            if record_id == request.request_id or record_id.endswith(f"_{request.request_id}"):
                out[record_id] = (request, oracle.reference(request.prompt_token_ids + tokens[:-1]))
    return out


def expected_row(reference: Reference, tensor_type: str, layer: int, position: int) -> np.ndarray:
    """What a correct capture delivers."""
    return reference.activations[(tensor_type, layer)][position]


def row_errors(records: dict[tuple, np.ndarray], refs: dict[str, tuple],
               expected=expected_row) -> dict[tuple, tuple[str, float]]:
    """Record key -> (tensor type, relative L2 error against expected(reference,
    tensor_type, layer, position)); rows whose expected row is None are left out."""
    errors = {}
    for key, row in records.items():
        record_id, point, layer, position = key
        request, reference = refs[record_id]
        tensor_type = next(p.tensor_type for p in request.points if p.name == point)
        want = expected(reference, tensor_type, layer, position)
        if want is not None:
            errors[key] = (tensor_type, relative_error(row, want))
    return errors


def worst_per_type(errors: dict[tuple, tuple[str, float]]) -> dict[str, float]:
    worst: dict[str, float] = {}
    for tensor_type, error in errors.values():
        worst[tensor_type] = max(worst.get(tensor_type, 0.0), error)
    return worst


def compare_with_oracle(oracle: TransformersOracle, run, requests,
                        expected=expected_row) -> dict[str, float]:
    """Checks every captured row against the oracle, within its dtype's tolerance;
    returns the worst error per tensor type. `run` has `tokens` and `records()`
    (as CaptureRun); a test of the comparison itself passes a wrong `expected`."""
    records = run.records()
    refs = references(oracle, run, requests)
    unknown = {k[0] for k in records} - set(refs)
    assert not unknown, f"records of unknown requests: {unknown}"
    errors = row_errors(records, refs, expected)
    for key, (_, error) in errors.items():
        assert error < oracle.tolerance, (
            f"{key}: relative L2 error {error:.2e} >= {oracle.tolerance:.1e} ({oracle.dtype})"
        )
    return worst_per_type(errors)


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
