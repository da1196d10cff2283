from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_TYPE_UNSPECIFIED: _ClassVar[TensorType]
    TENSOR_TYPE_RESIDUAL_STREAM: _ClassVar[TensorType]
    TENSOR_TYPE_ATTN_OUT: _ClassVar[TensorType]
    TENSOR_TYPE_MLP_OUT: _ClassVar[TensorType]
    TENSOR_TYPE_FINAL_NORM: _ClassVar[TensorType]

class FailurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_POLICY_UNSPECIFIED: _ClassVar[FailurePolicy]
    FAILURE_POLICY_FAIL_CLOSED: _ClassVar[FailurePolicy]
    FAILURE_POLICY_FAIL_OPEN: _ClassVar[FailurePolicy]

class ProbeAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_ACTION_UNSPECIFIED: _ClassVar[ProbeAction]
    PROBE_ACTION_OBSERVE: _ClassVar[ProbeAction]
    PROBE_ACTION_ABORT: _ClassVar[ProbeAction]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_PROBE_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_CLIENT_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ROUTER_UNAVAILABLE: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_CODE_UNSPECIFIED: _ClassVar[StatusCode]
    STATUS_CODE_CANCELLED: _ClassVar[StatusCode]
    STATUS_CODE_UNKNOWN: _ClassVar[StatusCode]
    STATUS_CODE_INVALID_ARGUMENT: _ClassVar[StatusCode]
    STATUS_CODE_DEADLINE_EXCEEDED: _ClassVar[StatusCode]
    STATUS_CODE_NOT_FOUND: _ClassVar[StatusCode]
    STATUS_CODE_ALREADY_EXISTS: _ClassVar[StatusCode]
    STATUS_CODE_PERMISSION_DENIED: _ClassVar[StatusCode]
    STATUS_CODE_RESOURCE_EXHAUSTED: _ClassVar[StatusCode]
    STATUS_CODE_FAILED_PRECONDITION: _ClassVar[StatusCode]
    STATUS_CODE_ABORTED: _ClassVar[StatusCode]
    STATUS_CODE_OUT_OF_RANGE: _ClassVar[StatusCode]
    STATUS_CODE_UNIMPLEMENTED: _ClassVar[StatusCode]
    STATUS_CODE_INTERNAL: _ClassVar[StatusCode]
    STATUS_CODE_UNAVAILABLE: _ClassVar[StatusCode]
    STATUS_CODE_DATA_LOSS: _ClassVar[StatusCode]
    STATUS_CODE_UNAUTHENTICATED: _ClassVar[StatusCode]
TENSOR_TYPE_UNSPECIFIED: TensorType
TENSOR_TYPE_RESIDUAL_STREAM: TensorType
TENSOR_TYPE_ATTN_OUT: TensorType
TENSOR_TYPE_MLP_OUT: TensorType
TENSOR_TYPE_FINAL_NORM: TensorType
FAILURE_POLICY_UNSPECIFIED: FailurePolicy
FAILURE_POLICY_FAIL_CLOSED: FailurePolicy
FAILURE_POLICY_FAIL_OPEN: FailurePolicy
PROBE_ACTION_UNSPECIFIED: ProbeAction
PROBE_ACTION_OBSERVE: ProbeAction
PROBE_ACTION_ABORT: ProbeAction
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_PROBE_ABORT: FinishReason
FINISH_REASON_CLIENT_ABORT: FinishReason
FINISH_REASON_ROUTER_UNAVAILABLE: FinishReason
FINISH_REASON_ERROR: FinishReason
STATUS_CODE_UNSPECIFIED: StatusCode
STATUS_CODE_CANCELLED: StatusCode
STATUS_CODE_UNKNOWN: StatusCode
STATUS_CODE_INVALID_ARGUMENT: StatusCode
STATUS_CODE_DEADLINE_EXCEEDED: StatusCode
STATUS_CODE_NOT_FOUND: StatusCode
STATUS_CODE_ALREADY_EXISTS: StatusCode
STATUS_CODE_PERMISSION_DENIED: StatusCode
STATUS_CODE_RESOURCE_EXHAUSTED: StatusCode
STATUS_CODE_FAILED_PRECONDITION: StatusCode
STATUS_CODE_ABORTED: StatusCode
STATUS_CODE_OUT_OF_RANGE: StatusCode
STATUS_CODE_UNIMPLEMENTED: StatusCode
STATUS_CODE_INTERNAL: StatusCode
STATUS_CODE_UNAVAILABLE: StatusCode
STATUS_CODE_DATA_LOSS: StatusCode
STATUS_CODE_UNAUTHENTICATED: StatusCode

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class IndexRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TokenSelector(_message.Message):
    __slots__ = ("scope", "indexes", "ranges")
    class Scope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SCOPE_UNSPECIFIED: _ClassVar[TokenSelector.Scope]
        SCOPE_PROMPT: _ClassVar[TokenSelector.Scope]
        SCOPE_GENERATED: _ClassVar[TokenSelector.Scope]
        SCOPE_ALL: _ClassVar[TokenSelector.Scope]
    SCOPE_UNSPECIFIED: TokenSelector.Scope
    SCOPE_PROMPT: TokenSelector.Scope
    SCOPE_GENERATED: TokenSelector.Scope
    SCOPE_ALL: TokenSelector.Scope
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    INDEXES_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    scope: TokenSelector.Scope
    indexes: _containers.RepeatedScalarFieldContainer[int]
    ranges: _containers.RepeatedCompositeFieldContainer[IndexRange]
    def __init__(self, scope: _Optional[_Union[TokenSelector.Scope, str]] = ..., indexes: _Optional[_Iterable[int]] = ..., ranges: _Optional[_Iterable[_Union[IndexRange, _Mapping]]] = ...) -> None: ...

class ExtractionPoint(_message.Message):
    __slots__ = ("name", "tensor_type", "layers", "tokens", "stream_to_client")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_TO_CLIENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor_type: TensorType
    layers: _containers.RepeatedScalarFieldContainer[int]
    tokens: TokenSelector
    stream_to_client: bool
    def __init__(self, name: _Optional[str] = ..., tensor_type: _Optional[_Union[TensorType, str]] = ..., layers: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Union[TokenSelector, _Mapping]] = ..., stream_to_client: _Optional[bool] = ...) -> None: ...

class ProbeBinding(_message.Message):
    __slots__ = ("probe", "failure_policy", "action")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    probe: str
    failure_policy: FailurePolicy
    action: ProbeAction
    def __init__(self, probe: _Optional[str] = ..., failure_policy: _Optional[_Union[FailurePolicy, str]] = ..., action: _Optional[_Union[ProbeAction, str]] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "tp_rank", "pp_rank", "start_layer", "end_layer", "has_final_norm")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    HAS_FINAL_NORM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    tp_rank: int
    pp_rank: int
    start_layer: int
    end_layer: int
    has_final_norm: bool
    def __init__(self, rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., has_final_norm: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "architecture", "num_layers", "hidden_size", "dtype", "tensor_parallel_size", "pipeline_parallel_size", "ranks", "tensor_types", "vocab_size", "max_model_len", "vllm_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TYPES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    num_layers: int
    hidden_size: int
    dtype: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    tensor_types: _containers.RepeatedScalarFieldContainer[TensorType]
    vocab_size: int
    max_model_len: int
    vllm_version: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., tensor_types: _Optional[_Iterable[_Union[TensorType, str]]] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vllm_version: _Optional[str] = ...) -> None: ...

class ActivationBlock(_message.Message):
    __slots__ = ("point", "tensor_type", "layer", "rows", "request_index", "token_positions", "is_generated")
    POINT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    IS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    point: str
    tensor_type: TensorType
    layer: int
    rows: Tensor
    request_index: _containers.RepeatedScalarFieldContainer[int]
    token_positions: _containers.RepeatedScalarFieldContainer[int]
    is_generated: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, point: _Optional[str] = ..., tensor_type: _Optional[_Union[TensorType, str]] = ..., layer: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., request_index: _Optional[_Iterable[int]] = ..., token_positions: _Optional[_Iterable[int]] = ..., is_generated: _Optional[_Iterable[bool]] = ...) -> None: ...

class ActivationBatch(_message.Message):
    __slots__ = ("step", "request_ids", "blocks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    blocks: _containers.RepeatedCompositeFieldContainer[ActivationBlock]
    def __init__(self, step: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., blocks: _Optional[_Iterable[_Union[ActivationBlock, _Mapping]]] = ...) -> None: ...

class ProbeScores(_message.Message):
    __slots__ = ("request_id", "probe", "token_positions", "scores", "router", "incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    probe: str
    token_positions: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    router: str
    incarnation: int
    def __init__(self, request_id: _Optional[str] = ..., probe: _Optional[str] = ..., token_positions: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., router: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("request_id", "probe", "score", "token_position", "reason", "router", "incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    probe: str
    score: float
    token_position: int
    reason: str
    router: str
    incarnation: int
    def __init__(self, request_id: _Optional[str] = ..., probe: _Optional[str] = ..., score: _Optional[float] = ..., token_position: _Optional[int] = ..., reason: _Optional[str] = ..., router: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

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
    probes: _containers.RepeatedCompositeFieldContainer[ProbeBinding]
    extraction_points: _containers.RepeatedCompositeFieldContainer[ExtractionPoint]
    gate_tokens: bool
    max_activation_message_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., probes: _Optional[_Iterable[_Union[ProbeBinding, _Mapping]]] = ..., extraction_points: _Optional[_Iterable[_Union[ExtractionPoint, _Mapping]]] = ..., gate_tokens: _Optional[bool] = ..., max_activation_message_bytes: _Optional[int] = ...) -> None: ...

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
    scores: ProbeScores
    def __init__(self, scores: _Optional[_Union[ProbeScores, _Mapping]] = ...) -> None: ...

class GenerateFinished(_message.Message):
    __slots__ = ("finish_reason", "verdict", "prompt_tokens", "generated_tokens", "unprobed_tokens", "dropped_records", "message", "bindings")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNPROBED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BINDINGS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    verdict: Verdict
    prompt_tokens: int
    generated_tokens: int
    unprobed_tokens: int
    dropped_records: int
    message: str
    bindings: _containers.RepeatedCompositeFieldContainer[BindingReport]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., unprobed_tokens: _Optional[int] = ..., dropped_records: _Optional[int] = ..., message: _Optional[str] = ..., bindings: _Optional[_Iterable[_Union[BindingReport, _Mapping]]] = ...) -> None: ...

class BindingReport(_message.Message):
    __slots__ = ("probe", "version", "digest", "failure_policy", "action", "rows_scored", "rows_unprobed", "state_restarts", "message")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ROWS_SCORED_FIELD_NUMBER: _ClassVar[int]
    ROWS_UNPROBED_FIELD_NUMBER: _ClassVar[int]
    STATE_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    probe: str
    version: str
    digest: str
    failure_policy: FailurePolicy
    action: ProbeAction
    rows_scored: int
    rows_unprobed: int
    state_restarts: int
    message: str
    def __init__(self, probe: _Optional[str] = ..., version: _Optional[str] = ..., digest: _Optional[str] = ..., failure_policy: _Optional[_Union[FailurePolicy, str]] = ..., action: _Optional[_Union[ProbeAction, str]] = ..., rows_scored: _Optional[int] = ..., rows_unprobed: _Optional[int] = ..., state_restarts: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

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
    activations: ActivationBatch
    finished: GenerateFinished
    def __init__(self, started: _Optional[_Union[GenerateStarted, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., probe_event: _Optional[_Union[ProbeEvent, _Mapping]] = ..., activations: _Optional[_Union[ActivationBatch, _Mapping]] = ..., finished: _Optional[_Union[GenerateFinished, _Mapping]] = ...) -> None: ...

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
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("engine_id", "model", "accepts_replies")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_REPLIES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: ModelInfo
    accepts_replies: bool
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., accepts_replies: _Optional[bool] = ...) -> None: ...

class SessionBinding(_message.Message):
    __slots__ = ("probe", "failure_policy", "action", "digest")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    probe: str
    failure_policy: FailurePolicy
    action: ProbeAction
    digest: str
    def __init__(self, probe: _Optional[str] = ..., failure_policy: _Optional[_Union[FailurePolicy, str]] = ..., action: _Optional[_Union[ProbeAction, str]] = ..., digest: _Optional[str] = ...) -> None: ...

class RequestStart(_message.Message):
    __slots__ = ("request_id", "prompt_length", "state_reset", "incarnation", "bindings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATE_RESET_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BINDINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_length: int
    state_reset: bool
    incarnation: int
    bindings: _containers.RepeatedCompositeFieldContainer[SessionBinding]
    def __init__(self, request_id: _Optional[str] = ..., prompt_length: _Optional[int] = ..., state_reset: _Optional[bool] = ..., incarnation: _Optional[int] = ..., bindings: _Optional[_Iterable[_Union[SessionBinding, _Mapping]]] = ...) -> None: ...

class RequestEnd(_message.Message):
    __slots__ = ("request_id", "finish_reason", "incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: FinishReason
    incarnation: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_unix_nanos",)
    SENT_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    sent_unix_nanos: int
    def __init__(self, sent_unix_nanos: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("hello", "request_start", "batch", "request_end", "heartbeat")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REQUEST_START_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_END_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    hello: SessionHello
    request_start: RequestStart
    batch: ActivationBatch
    request_end: RequestEnd
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ..., request_start: _Optional[_Union[RequestStart, _Mapping]] = ..., batch: _Optional[_Union[ActivationBatch, _Mapping]] = ..., request_end: _Optional[_Union[RequestEnd, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class ProbeInfo(_message.Message):
    __slots__ = ("name", "kind", "tensor_type", "layers", "hidden_size", "dtype", "action", "threshold", "version", "tokens", "active_requests", "unloading", "digest", "stateful")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UNLOADING_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATEFUL_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    tensor_type: TensorType
    layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    dtype: str
    action: ProbeAction
    threshold: float
    version: str
    tokens: TokenSelector
    active_requests: int
    unloading: bool
    digest: str
    stateful: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., tensor_type: _Optional[_Union[TensorType, str]] = ..., layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., action: _Optional[_Union[ProbeAction, str]] = ..., threshold: _Optional[float] = ..., version: _Optional[str] = ..., tokens: _Optional[_Union[TokenSelector, _Mapping]] = ..., active_requests: _Optional[int] = ..., unloading: _Optional[bool] = ..., digest: _Optional[str] = ..., stateful: _Optional[bool] = ...) -> None: ...

class RouterHello(_message.Message):
    __slots__ = ("router_id", "probes")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    probes: _containers.RepeatedCompositeFieldContainer[ProbeInfo]
    def __init__(self, router_id: _Optional[str] = ..., probes: _Optional[_Iterable[_Union[ProbeInfo, _Mapping]]] = ...) -> None: ...

class ProbeCatalog(_message.Message):
    __slots__ = ("probes",)
    PROBES_FIELD_NUMBER: _ClassVar[int]
    probes: _containers.RepeatedCompositeFieldContainer[ProbeInfo]
    def __init__(self, probes: _Optional[_Iterable[_Union[ProbeInfo, _Mapping]]] = ...) -> None: ...

class StepAck(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "probe", "code", "message", "incarnation", "step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    probe: str
    code: StatusCode
    message: str
    incarnation: int
    step: int
    def __init__(self, request_id: _Optional[str] = ..., probe: _Optional[str] = ..., code: _Optional[_Union[StatusCode, str]] = ..., message: _Optional[str] = ..., incarnation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("hello", "scores", "abort", "ack", "heartbeat", "drain", "error", "catalog", "replies")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CATALOG_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    hello: RouterHello
    scores: ProbeScores
    abort: Verdict
    ack: StepAck
    heartbeat: Heartbeat
    drain: Drain
    error: RequestError
    catalog: ProbeCatalog
    replies: SessionReplies
    def __init__(self, hello: _Optional[_Union[RouterHello, _Mapping]] = ..., scores: _Optional[_Union[ProbeScores, _Mapping]] = ..., abort: _Optional[_Union[Verdict, _Mapping]] = ..., ack: _Optional[_Union[StepAck, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., catalog: _Optional[_Union[ProbeCatalog, _Mapping]] = ..., replies: _Optional[_Union[SessionReplies, _Mapping]] = ...) -> None: ...

class SessionReplies(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[SessionResponse]
    def __init__(self, messages: _Optional[_Iterable[_Union[SessionResponse, _Mapping]]] = ...) -> None: ...

class LoadProbeRequest(_message.Message):
    __slots__ = ("path", "inline", "replace")
    PATH_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    path: str
    inline: InlineProbe
    replace: bool
    def __init__(self, path: _Optional[str] = ..., inline: _Optional[_Union[InlineProbe, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class LoadProbeResponse(_message.Message):
    __slots__ = ("probe",)
    PROBE_FIELD_NUMBER: _ClassVar[int]
    probe: ProbeInfo
    def __init__(self, probe: _Optional[_Union[ProbeInfo, _Mapping]] = ...) -> None: ...

class InlineProbe(_message.Message):
    __slots__ = ("manifest_json", "weights_safetensors")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    weights_safetensors: bytes
    def __init__(self, manifest_json: _Optional[str] = ..., weights_safetensors: _Optional[bytes] = ...) -> None: ...

class ListProbesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProbesResponse(_message.Message):
    __slots__ = ("probes",)
    PROBES_FIELD_NUMBER: _ClassVar[int]
    probes: _containers.RepeatedCompositeFieldContainer[ProbeInfo]
    def __init__(self, probes: _Optional[_Iterable[_Union[ProbeInfo, _Mapping]]] = ...) -> None: ...

class UnloadProbeRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class UnloadProbeResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...
