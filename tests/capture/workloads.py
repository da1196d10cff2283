"""Requests the vLLM tests run: mixed prompt lengths and selectors."""

from common.capture_spec import ExtractionPoint, Scope, TokenSelector
from tools.capture_engines import Request

LAYERS = (0, 1, 2, 3)


def every_tensor_type(prefix: str = "") -> list[ExtractionPoint]:
    return [
        ExtractionPoint(f"{prefix}residual", "residual_stream", LAYERS),
        ExtractionPoint(f"{prefix}attn", "attn_out", LAYERS),
        ExtractionPoint(f"{prefix}mlp", "mlp_out", LAYERS),
        ExtractionPoint(f"{prefix}norm", "final_norm"),
    ]


def every_position(tag: str) -> list[Request]:
    """Every tensor type on every layer for every position, with prompt lengths below,
    at and above one step's 32-token budget (chunked prefill)."""
    return [
        Request(f"{tag}-{length}", prompt(length, length), every_tensor_type(), max_tokens=6)
        for length in (3, 16, 45)
    ]


def prompt(length: int, seed: int) -> list[int]:
    """Deterministic token ids in the tiny vocabulary, past the special tokens."""
    return [3 + (seed * 31 + i * 17) % 500 for i in range(length)]


def mixed_selectors(tag: str) -> list[Request]:
    """Concurrent requests whose points differ: scopes, negative prompt indexes,
    open ranges, and one point whose layers span both halves of the model."""
    return [
        Request(f"{tag}-all", prompt(5, 1), every_tensor_type(), max_tokens=4),
        Request(
            f"{tag}-last-prompt",
            prompt(37, 2),  # longer than one step's token budget: chunked prefill
            [
                ExtractionPoint("last", "residual_stream", (1, 2), TokenSelector(Scope.PROMPT, (-1,))),
                ExtractionPoint("gen-mlp", "mlp_out", (3,), TokenSelector(Scope.GENERATED, ranges=((1, None),))),
            ],
            max_tokens=4,
        ),
        Request(
            f"{tag}-span",
            prompt(9, 3),
            [
                ExtractionPoint("span", "residual_stream", LAYERS, TokenSelector(Scope.ALL, ranges=((6, None),))),
                ExtractionPoint("norm-first-gen", "final_norm", (), TokenSelector(Scope.GENERATED, (0,))),
            ],
            max_tokens=4,
        ),
    ]
