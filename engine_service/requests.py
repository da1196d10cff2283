"""Checks a client's GenerateRequest and translates it for vLLM.

Plain logic, no vLLM import: every check names the field and the reason, so
a bad request becomes INVALID_ARGUMENT with a message a client can act on.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from common.errors import InvalidArgument
from undercurrent.v1 import undercurrent_pb2 as pb

MAX_REQUEST_ID_CHARS = 256
DEFAULT_MAX_TOKENS = 64


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class SamplingChoice:
    """The sampling fields vLLM's SamplingParams takes, already checked."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    repetition_penalty: float

    def as_kwargs(self) -> dict:
        return dict(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
        )


def request_id_of(request: pb.GenerateRequest) -> str:
    """The client's id, or a fresh one; ids are plain printable text."""
    rid = request.request_id
    if not rid:
        return f"req-{uuid.uuid4().hex[:16]}"
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id: {len(rid)} characters, at most {MAX_REQUEST_ID_CHARS}")
    if not rid.isprintable():
        raise InvalidArgument("request_id: must be printable text")
    return rid


def prompt_ids(request: pb.GenerateRequest, tokenize, limits: ModelLimits) -> list[int]:
    """Token ids of the prompt, from text (tokenized) or given ids (checked)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("prompt: set either text or token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidArgument("prompt.text: is empty")
        ids = list(tokenize(request.text))
        if not ids:
            raise InvalidArgument("prompt.text: tokenizes to no tokens")
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgument("prompt.token_ids: is empty")
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidArgument(
                f"prompt.token_ids: {bad[:5]} outside the vocabulary [0, {limits.vocab_size})"
            )
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(
            f"prompt: {len(ids)} tokens leave no room to generate within max_model_len "
            f"{limits.max_model_len}"
        )
    return ids


def sampling_choice(sampling: pb.SamplingParams, prompt_len: int, limits: ModelLimits) -> SamplingChoice:
    room = limits.max_model_len - prompt_len
    max_tokens = sampling.max_tokens or min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise InvalidArgument(
            f"sampling.max_tokens: {max_tokens} plus the {prompt_len}-token prompt exceeds "
            f"max_model_len {limits.max_model_len}"
        )
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(f"sampling.temperature: {temperature} must be >= 0")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"sampling.top_p: {top_p} must be in (0, 1]")
    top_k = sampling.top_k if sampling.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidArgument(f"sampling.top_k: {top_k} must be >= 0 (0 disables it)")
    penalty = sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0
    if not math.isfinite(penalty) or penalty <= 0:
        raise InvalidArgument(f"sampling.repetition_penalty: {penalty} must be > 0")
    if any(not s for s in sampling.stop):
        raise InvalidArgument("sampling.stop: contains an empty string")
    return SamplingChoice(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        ignore_eos=sampling.ignore_eos,
        repetition_penalty=penalty,
    )


# vLLM finish reasons -> ours; abort is refined by who asked for it.
VLLM_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_CLIENT_ABORT, "error": pb.FINISH_REASON_ERROR}
