"""A Generate stream's events as OpenAI responses and chunks (vLLM's protocol
models), with what OpenAI has no field for in `undercurrent`. Plain logic.

- A probe abort ends the choice with finish_reason "content_filter" (OpenAI's
  convention for output its filters stopped), and so does a fail_closed
  binding whose router was unreachable; `undercurrent.finish_reason` tells the
  two apart and `undercurrent.verdict` carries the evidence (probe, score,
  token position and its index among the generated tokens, router).
- Scores of observed probes stream as chunks without choices carrying
  `undercurrent.scores` (a whole response lists them all).
- Usage counts the tokens the client received, and adds the tokens generated,
  those no router scored (fail_open) and the records dropped.
- An engine error is an error, not a finish: a 500 before the answer, an
  error event in a stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from google.protobuf import descriptor, json_format
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from common.enum_names import short_name
from engine_service.openai_api.requests import OpenAIError
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

FINISH_REASONS = {
    types_pb.FINISH_REASON_STOP: "stop",
    types_pb.FINISH_REASON_LENGTH: "length",
    types_pb.FINISH_REASON_PROBE_ABORT: "content_filter",
    types_pb.FINISH_REASON_ROUTER_UNAVAILABLE: "content_filter",
    types_pb.FINISH_REASON_CLIENT_ABORT: "abort",  # vLLM's own word for an aborted request
}


_INT64 = {descriptor.FieldDescriptor.TYPE_INT64, descriptor.FieldDescriptor.TYPE_UINT64,
          descriptor.FieldDescriptor.TYPE_SINT64, descriptor.FieldDescriptor.TYPE_FIXED64,
          descriptor.FieldDescriptor.TYPE_SFIXED64}


def finish_reason(finished: engine_pb.GenerateFinished) -> str:
    """OpenAI's finish_reason; OpenAIError (500) for an engine error."""
    reason = FINISH_REASONS.get(finished.finish_reason)
    if reason is None:
        raise OpenAIError(f"the engine failed the request: {finished.message or 'no detail'}", None, 500,
                          "internal_error")
    return reason


def _message(message, **names) -> dict:
    """A contract message as JSON with the field names of the proto and the
    short lower-case names of its enum values."""
    data = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    for field in message.DESCRIPTOR.fields:  # proto JSON writes 64-bit integers as strings
        if field.type in _INT64 and field.name in data:
            data[field.name] = int(data[field.name])
    for key, enum in names.items():
        data[key] = short_name(enum, getattr(message, key)).lower()
    return data


def scores(event: types_pb.ProbeScores) -> dict:
    return {"probe": event.probe, "router": event.router, "token_positions": list(event.token_positions),
            "scores": list(event.scores)}


def activations(batch: types_pb.ActivationBatch) -> dict:
    """An activation batch as the contract's JSON: rows as base64 raw little-endian bytes."""
    return json_format.MessageToDict(batch, preserving_proto_field_name=True)


def finish_extension(finished: engine_pb.GenerateFinished, request_id: str) -> dict:
    """Why the request ended and what was in force: `undercurrent` of the last chunk or the response."""
    data = {
        "request_id": request_id,
        "finish_reason": short_name(types_pb.FinishReason, finished.finish_reason),
        "message": finished.message,
        "gated": finished.gated,
        "bindings": [_message(b, failure_policy=types_pb.FailurePolicy, action=types_pb.ProbeAction) for b in finished.bindings],
    }
    if finished.HasField("verdict"):
        verdict = _message(finished.verdict)
        verdict["generated_index"] = finished.verdict.token_position - finished.prompt_tokens
        data["verdict"] = verdict
    return data


def usage(finished: engine_pb.GenerateFinished, received: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=finished.prompt_tokens, completion_tokens=received,
                     total_tokens=finished.prompt_tokens + received, generated_tokens=finished.generated_tokens,
                     unprobed_tokens=finished.unprobed_tokens, dropped_records=finished.dropped_records)


@dataclass
class Shape:
    """One answer's identity: chat or text completion, its id, model and time."""

    chat: bool
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              extension: dict | None = None, usage_info: UsageInfo | None = None, no_choice: bool = False):
        """One streamed chunk: text and/or a finish of choice 0, or (no_choice) none,
        as OpenAI sends usage and as scores travel."""
        extra = {"undercurrent": extension} if extension is not None else {}
        if self.chat:
            choices = [] if no_choice else [ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(role="assistant" if role else None, content=text), finish_reason=finish)]
            return ChatCompletionStreamResponse(id=self.id, model=self.model, created=self.created, choices=choices,
                                                usage=usage_info, **extra)
        choices = [] if no_choice else [CompletionResponseStreamChoice(index=0, text=text or "", finish_reason=finish)]
        return CompletionStreamResponse(id=self.id, model=self.model, created=self.created, choices=choices,
                                        usage=usage_info, **extra)

    def response(self, collected: "Collected"):
        """The whole answer (not streamed)."""
        finished = collected.finished
        reason = finish_reason(finished)
        extension = finish_extension(finished, collected.request_id)
        extension["scores"] = collected.scores
        if collected.activations:
            extension["activations"] = collected.activations
        shared = dict(id=self.id, model=self.model, created=self.created,
                      usage=usage(finished, collected.received), undercurrent=extension)
        if self.chat:
            message = ChatMessage(role="assistant", content=collected.text)
            return ChatCompletionResponse(
                choices=[ChatCompletionResponseChoice(index=0, message=message, finish_reason=reason)], **shared)
        return CompletionResponse(
            choices=[CompletionResponseChoice(index=0, text=collected.text, finish_reason=reason)], **shared)


@dataclass
class Collected:
    """A whole Generate stream, for an answer that is not streamed."""

    request_id: str = ""
    text: str = ""
    received: int = 0
    scores: list[dict] = field(default_factory=list)
    activations: list[dict] = field(default_factory=list)
    finished: engine_pb.GenerateFinished | None = None

    def add(self, response: engine_pb.GenerateResponse) -> None:
        kind = response.WhichOneof("event")
        if kind == "started":
            self.request_id = response.started.request_id
        elif kind == "tokens":
            self.text += response.tokens.text
            self.received += len(response.tokens.token_ids)
        elif kind == "probe_event":
            self.scores.append(scores(response.probe_event.scores))
        elif kind == "activations":
            self.activations.append(activations(response.activations))
        elif kind == "finished":
            self.finished = response.finished
