"""OpenAI requests (vLLM's protocol models) as GenerateRequests, and the
engine's errors as OpenAI errors. Plain logic: no server, no engine.

What the contract cannot honour is refused, never ignored: a field this
engine does not support, set to anything but its default, is a 400 naming
the field, and so is a field OpenAI does not define (OpenAI's own answer to
an unknown argument). The `undercurrent` object (the SDKs' `extra_body`)
carries what OpenAI has no field for: probe bindings, gating, extraction
points and the request id.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Literal

from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, ValidationError

from common import errors
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

EXTENSION = "undercurrent"

# Fields of vLLM's request models the engine honours (beside the prompt).
SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
            "n", "ignore_eos", "repetition_penalty", "user", "request_id"}
CHAT = SAMPLING | {"messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
                   "add_special_tokens", "chat_template", "chat_template_kwargs", "documents"}
COMPLETION = SAMPLING | {"prompt"}

# Values of unsupported fields that change nothing (SDKs and gateways send them).
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": False, "echo": False, "tools": [],
           "parallel_tool_calls": True, "min_tokens": 0, "min_p": 0.0}

POLICIES = {"fail_closed": types_pb.FAILURE_POLICY_FAIL_CLOSED, "fail_open": types_pb.FAILURE_POLICY_FAIL_OPEN}
ACTIONS = {"abort": types_pb.PROBE_ACTION_ABORT, "observe": types_pb.PROBE_ACTION_OBSERVE}

# The contract's field names in the engine's messages, as a body's paths.
_PARAMS = (("sampling.max_tokens", "max_tokens"), ("sampling.", ""), ("prompt", "prompt"),
           ("probes", f"{EXTENSION}.probes"), ("extraction_points", f"{EXTENSION}.extraction_points"),
           ("gate_tokens", f"{EXTENSION}.gate_tokens"), ("request_id", f"{EXTENSION}.request_id"))

_STATUS = {
    errors.InvalidArgument: (HTTPStatus.BAD_REQUEST, "invalid_request_error"),
    errors.FailedPrecondition: (HTTPStatus.BAD_REQUEST, "invalid_request_error"),
    errors.NotFound: (HTTPStatus.NOT_FOUND, "not_found_error"),
    errors.AlreadyExists: (HTTPStatus.CONFLICT, "conflict_error"),
    errors.ResourceExhausted: (HTTPStatus.TOO_MANY_REQUESTS, "rate_limit_error"),
    errors.Unavailable: (HTTPStatus.SERVICE_UNAVAILABLE, "service_unavailable"),
}


class OpenAIError(Exception):
    """An error as OpenAI answers it: status, type, message, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = HTTPStatus.BAD_REQUEST,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, int(status), kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def from_engine(err: errors.UndercurrentError) -> OpenAIError:
    """An engine error (its message starts with the contract's field) with the
    field named as the body's path."""
    status, kind = next(((s, k) for cls, (s, k) in _STATUS.items() if isinstance(err, cls)),
                        (HTTPStatus.INTERNAL_SERVER_ERROR, "internal_error"))
    message = str(err)
    field, sep, rest = message.partition(": ")
    if not sep or " " in field:
        return OpenAIError(message, None, status, kind)
    for prefix, path in _PARAMS:
        if field.startswith(prefix):
            field = path + field[len(prefix):]
            break
    return OpenAIError(f"{field}: {rest}", field, status, kind)


class ProbeBinding(BaseModel):
    model_config = ConfigDict(extra="forbid")
    probe: str
    failure_policy: Literal["fail_closed", "fail_open"] | None = None
    action: Literal["abort", "observe"] | None = None


class Extension(BaseModel):
    """The `undercurrent` object of a request body."""

    model_config = ConfigDict(extra="forbid")
    probes: list[ProbeBinding] = []
    gate_tokens: bool | None = None
    extraction_points: list[dict] = []
    request_id: str | None = None


@dataclass(frozen=True)
class Translated:
    request: engine_pb.GenerateRequest
    stream: bool
    include_usage: bool


def check_fields(request: BaseModel, supported: set[str]) -> None:
    """400 naming the first field OpenAI does not define, or that this engine
    does not support and the request set to other than its default."""
    for name in (request.model_extra or {}):
        if name != EXTENSION:
            raise OpenAIError(f"Unrecognized request argument supplied: {name}", name)
    for name, field in type(request).model_fields.items():  # in OpenAI's order: the field given comes first
        if name in supported or name not in request.model_fields_set:
            continue
        value = getattr(request, name)
        if value is not None and value != NEUTRAL.get(name) and (
                field.default_factory is not None or value != field.default):
            raise OpenAIError(f"{name}: not supported by this engine (Undercurrent serves a subset of vLLM's "
                              "fields; see docs/openai.md)", name)
    if request.n not in (None, 1):
        raise OpenAIError(f"n: {request.n}; this engine makes one choice per request", "n")


def extension(request: BaseModel) -> Extension:
    raw = (request.model_extra or {}).get(EXTENSION) or {}
    try:
        return Extension.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in (EXTENSION, *first["loc"]))
        raise OpenAIError(f"{where}: {first['msg']}", where) from None


def generate_request(request: BaseModel, supported: set[str], max_tokens: int | None) -> Translated:
    """The request's sampling, stream choice and extension as a GenerateRequest
    without its prompt. max_tokens: the body's choice (None: the engine's default)."""
    check_fields(request, supported)
    ext = extension(request)
    message = engine_pb.GenerateRequest(request_id=ext.request_id or "")
    sampling = message.sampling
    if max_tokens is not None:
        if max_tokens < 1:
            raise OpenAIError(f"max_tokens: {max_tokens}; must be at least 1", "max_tokens")
        sampling.max_tokens = max_tokens
    for name in ("temperature", "top_p", "seed", "repetition_penalty"):
        if getattr(request, name) is not None:
            setattr(sampling, name, getattr(request, name))
    if request.top_k not in (None, -1, 0):  # vLLM's "off" is -1 or 0, the contract's 0
        sampling.top_k = request.top_k
    if request.stop:
        sampling.stop.extend([request.stop] if isinstance(request.stop, str) else request.stop)
    sampling.ignore_eos = bool(request.ignore_eos)
    for binding in ext.probes:
        message.probes.add(probe=binding.probe, failure_policy=POLICIES.get(binding.failure_policy, 0),
                           action=ACTIONS.get(binding.action, 0))
    if ext.gate_tokens is not None:
        message.gate_tokens = ext.gate_tokens
    for i, point in enumerate(ext.extraction_points):
        try:
            message.extraction_points.append(json_format.ParseDict(point, types_pb.ExtractionPoint()))
        except json_format.ParseError as err:
            where = f"{EXTENSION}.extraction_points[{i}]"
            raise OpenAIError(f"{where}: {err}", where) from None
    options = request.stream_options
    return Translated(message, bool(request.stream), bool(request.stream and options and options.include_usage))


def completion_prompt(prompt) -> dict:
    """The completions prompt as the contract's prompt: text, or token ids; one prompt per request."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"token_ids": engine_pb.TokenIds(ids=prompt)}
    raise OpenAIError("prompt: give one prompt, as a string or a list of token ids", "prompt")
