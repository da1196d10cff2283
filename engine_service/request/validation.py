"""Checks a client's GenerateRequest and translates it for vLLM.

Plain logic, no vLLM import: every check names the field and the reason, so
a bad request becomes INVALID_ARGUMENT with a message a client can act on.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass

from common.enum_checks import check_enums
from common.errors import InvalidArgument, ResourceExhausted
from common.grpc_server import MAX_MESSAGE_BYTES
from undercurrent.v1 import engine_pb2 as engine_pb

MAX_REQUEST_ID_CHARS = 256
DEFAULT_MAX_TOKENS = 64

# Limits a client meets (the engine's flags; see docs/engine.md "Limits").
DEFAULT_MAX_STREAMS = 256
DEFAULT_MAX_EXTRACTION_POINTS = 64
DEFAULT_CLIENT_QUEUE_BYTES = 32 * 1024 * 1024
# A prompt this many bytes per token of max_model_len cannot fit (a token
# rarely spans more than a few bytes), so it is refused before tokenizing.
PROMPT_BYTES_PER_TOKEN = 32
# What a GenerateRequest may hold beside its prompt (bindings, extraction points
# with their token indexes, sampling): the client port's receive limit is the
# prompt's limit plus this.
REQUEST_BYTES_BEYOND_PROMPT = 1024 * 1024
DEFAULT_CLIENT_ACTIVATION_MESSAGE_BYTES = 4 * 1024 * 1024  # most gRPC clients' receive limit
MIN_CLIENT_ACTIVATION_MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """What one engine accepts; past a limit a request gets RESOURCE_EXHAUSTED
    (or INVALID_ARGUMENT for a prompt that cannot fit)."""

    max_streams: int = DEFAULT_MAX_STREAMS  # concurrent Generate streams
    max_extraction_points: int = DEFAULT_MAX_EXTRACTION_POINTS  # per request
    max_prompt_bytes: int = 0  # prompt.text in UTF-8; 0: PROMPT_BYTES_PER_TOKEN * max_model_len
    max_message_bytes: int = MAX_MESSAGE_BYTES  # the server's gRPC limit
    client_queue_bytes: int = DEFAULT_CLIENT_QUEUE_BYTES  # queued events per request

    def prompt_bytes(self, max_model_len: int) -> int:
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_model_len

    def request_bytes(self, max_model_len: int) -> int:
        """The largest GenerateRequest the client port receives: a prompt that
        can fit, and the rest of the request. A 64 MiB request from anyone who
        can connect is memory the engine never needs to buffer."""
        return self.prompt_bytes(max_model_len) + REQUEST_BYTES_BEYOND_PROMPT


def check_request(request: engine_pb.GenerateRequest, running: int, limits: RequestLimits,
                  model: "ModelLimits") -> None:
    """The checks that need no tokenizer and no model: enums, limits, prompt size.
    Cheap, so they run on the event loop before anything costly."""
    check_enums(request)
    check_capacity(running, limits)
    if len(request.extraction_points) > limits.max_extraction_points:
        raise ResourceExhausted(
            f"extraction_points: {len(request.extraction_points)} points, at most "
            f"{limits.max_extraction_points} per request (--max-extraction-points)"
        )
    if request.WhichOneof("prompt") == "text":
        allowed = limits.prompt_bytes(model.max_model_len)
        # A str has at most as many characters as its UTF-8 bytes: the length alone
        # refuses most oversized prompts without encoding them.
        size = len(request.text)
        if size <= allowed:
            size = len(request.text.encode("utf-8", "surrogatepass"))
        if size > allowed:
            raise InvalidArgument(
                f"prompt.text: over {allowed} bytes (--max-prompt-bytes); it cannot fit "
                f"max_model_len {model.max_model_len} tokens"
            )


def check_capacity(running: int, limits: RequestLimits) -> None:
    if running >= limits.max_streams:
        raise ResourceExhausted(
            f"the engine already runs {running} Generate streams, its --max-streams; retry later"
        )


def client_message_bytes(request: engine_pb.GenerateRequest, limits: RequestLimits) -> int:
    """The largest activation message this client takes: its choice, or 4 MiB,
    capped at the server's own limit."""
    wanted = request.max_activation_message_bytes or DEFAULT_CLIENT_ACTIVATION_MESSAGE_BYTES
    if wanted < MIN_CLIENT_ACTIVATION_MESSAGE_BYTES:
        raise InvalidArgument(
            f"max_activation_message_bytes: {wanted} is under the minimum "
            f"{MIN_CLIENT_ACTIVATION_MESSAGE_BYTES}"
        )
    return min(wanted, limits.max_message_bytes)


async def prompt_ids_off_loop(request: engine_pb.GenerateRequest, tokenize, limits: "ModelLimits") -> list[int]:
    """prompt_ids in a worker thread: tokenizing a long text takes long, and the
    event loop serves every other stream, drain and heartbeat meanwhile."""
    if request.WhichOneof("prompt") != "text":
        return prompt_ids(request, tokenize, limits)
    return await asyncio.to_thread(prompt_ids, request, tokenize, limits)


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


def request_id_of(request: engine_pb.GenerateRequest) -> str:
    """The client's id, or a fresh one; ids are plain printable text."""
    rid = request.request_id
    if not rid:
        return f"req-{uuid.uuid4().hex[:16]}"
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id: {len(rid)} characters, at most {MAX_REQUEST_ID_CHARS}")
    if not rid.isprintable():
        raise InvalidArgument("request_id: must be printable text")
    return rid


def prompt_ids(request: engine_pb.GenerateRequest, tokenize, limits: ModelLimits) -> list[int]:
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


def sampling_choice(sampling: engine_pb.SamplingParams, prompt_tokens: int, limits: ModelLimits) -> SamplingChoice:
    room = limits.max_model_len - prompt_tokens
    max_tokens = sampling.max_tokens or min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise InvalidArgument(
            f"sampling.max_tokens: {max_tokens} plus the {prompt_tokens}-token prompt exceeds "
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
