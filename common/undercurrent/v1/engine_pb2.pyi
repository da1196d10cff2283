from undercurrent.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "repetition_penalty")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    repetition_penalty: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "probes", "extraction_points", "gate_tokens", "max_activation_message_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    EXTRACTION_POINTS_FIELD_NUMBER: _ClassVar[int]
    GATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVATION_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    probes: _containers.RepeatedCompositeFieldContainer[_types_pb2.ProbeBinding]
    extraction_points: _containers.RepeatedCompositeFieldContainer[_types_pb2.ExtractionPoint]
    gate_tokens: bool
    max_activation_message_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., probes: _Optional[_Iterable[_Union[_types_pb2.ProbeBinding, _Mapping]]] = ..., extraction_points: _Optional[_Iterable[_Union[_types_pb2.ExtractionPoint, _Mapping]]] = ..., gate_tokens: _Optional[bool] = ..., max_activation_message_bytes: _Optional[int] = ...) -> None: ...

class GenerateStarted(_message.Message):
    __slots__ = ("request_id", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "first_index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    first_index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., first_index: _Optional[int] = ...) -> None: ...

class ProbeEvent(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _types_pb2.ProbeScores
    def __init__(self, scores: _Optional[_Union[_types_pb2.ProbeScores, _Mapping]] = ...) -> None: ...

class GenerateFinished(_message.Message):
    __slots__ = ("finish_reason", "verdict", "prompt_tokens", "generated_tokens", "unprobed_tokens", "dropped_records", "message", "bindings", "gated")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNPROBED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BINDINGS_FIELD_NUMBER: _ClassVar[int]
    GATED_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _types_pb2.FinishReason
    verdict: _types_pb2.Verdict
    prompt_tokens: int
    generated_tokens: int
    unprobed_tokens: int
    dropped_records: int
    message: str
    bindings: _containers.RepeatedCompositeFieldContainer[BindingReport]
    gated: bool
    def __init__(self, finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., verdict: _Optional[_Union[_types_pb2.Verdict, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., unprobed_tokens: _Optional[int] = ..., dropped_records: _Optional[int] = ..., message: _Optional[str] = ..., bindings: _Optional[_Iterable[_Union[BindingReport, _Mapping]]] = ..., gated: _Optional[bool] = ...) -> None: ...

class BindingReport(_message.Message):
    __slots__ = ("probe", "version", "digest", "failure_policy", "action", "rows_scored", "rows_unprobed", "state_restarts", "message", "operator_set")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ROWS_SCORED_FIELD_NUMBER: _ClassVar[int]
    ROWS_UNPROBED_FIELD_NUMBER: _ClassVar[int]
    STATE_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_SET_FIELD_NUMBER: _ClassVar[int]
    probe: str
    version: str
    digest: str
    failure_policy: _types_pb2.FailurePolicy
    action: _types_pb2.ProbeAction
    rows_scored: int
    rows_unprobed: int
    state_restarts: int
    message: str
    operator_set: bool
    def __init__(self, probe: _Optional[str] = ..., version: _Optional[str] = ..., digest: _Optional[str] = ..., failure_policy: _Optional[_Union[_types_pb2.FailurePolicy, str]] = ..., action: _Optional[_Union[_types_pb2.ProbeAction, str]] = ..., rows_scored: _Optional[int] = ..., rows_unprobed: _Optional[int] = ..., state_restarts: _Optional[int] = ..., message: _Optional[str] = ..., operator_set: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "tokens", "probe_event", "activations", "finished")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBE_EVENT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: GenerateStarted
    tokens: TokenChunk
    probe_event: ProbeEvent
    activations: _types_pb2.ActivationBatch
    finished: GenerateFinished
    def __init__(self, started: _Optional[_Union[GenerateStarted, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., probe_event: _Optional[_Union[ProbeEvent, _Mapping]] = ..., activations: _Optional[_Union[_types_pb2.ActivationBatch, _Mapping]] = ..., finished: _Optional[_Union[GenerateFinished, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: _types_pb2.ModelInfo
    def __init__(self, model: _Optional[_Union[_types_pb2.ModelInfo, _Mapping]] = ...) -> None: ...
