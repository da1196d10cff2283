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

class ProbeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_KIND_UNSPECIFIED: _ClassVar[ProbeKind]
    PROBE_KIND_LINEAR: _ClassVar[ProbeKind]
    PROBE_KIND_LOGISTIC: _ClassVar[ProbeKind]
    PROBE_KIND_MEAN_DIFFERENCE: _ClassVar[ProbeKind]
    PROBE_KIND_NORM: _ClassVar[ProbeKind]
    PROBE_KIND_TRAJECTORY: _ClassVar[ProbeKind]
    PROBE_KIND_CASCADE: _ClassVar[ProbeKind]

class ProbeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_ROLE_UNSPECIFIED: _ClassVar[ProbeRole]
    PROBE_ROLE_SERVING: _ClassVar[ProbeRole]
    PROBE_ROLE_CANARY: _ClassVar[ProbeRole]
    PROBE_ROLE_SHADOW: _ClassVar[ProbeRole]
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
PROBE_KIND_UNSPECIFIED: ProbeKind
PROBE_KIND_LINEAR: ProbeKind
PROBE_KIND_LOGISTIC: ProbeKind
PROBE_KIND_MEAN_DIFFERENCE: ProbeKind
PROBE_KIND_NORM: ProbeKind
PROBE_KIND_TRAJECTORY: ProbeKind
PROBE_KIND_CASCADE: ProbeKind
PROBE_ROLE_UNSPECIFIED: ProbeRole
PROBE_ROLE_SERVING: ProbeRole
PROBE_ROLE_CANARY: ProbeRole
PROBE_ROLE_SHADOW: ProbeRole

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
    __slots__ = ("request_id", "probe", "token_positions", "scores", "router")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    probe: str
    token_positions: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    router: str
    def __init__(self, request_id: _Optional[str] = ..., probe: _Optional[str] = ..., token_positions: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., router: _Optional[str] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("request_id", "probe", "score", "token_position", "reason", "router")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    probe: str
    score: float
    token_position: int
    reason: str
    router: str
    def __init__(self, request_id: _Optional[str] = ..., probe: _Optional[str] = ..., score: _Optional[float] = ..., token_position: _Optional[int] = ..., reason: _Optional[str] = ..., router: _Optional[str] = ...) -> None: ...

class ProbeInfo(_message.Message):
    __slots__ = ("name", "kind", "tensor_type", "layers", "hidden_size", "dtype", "action", "threshold", "version", "tokens", "active_requests", "unloading", "digest", "stateful", "role", "canary_share", "canary")
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
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CANARY_SHARE_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: ProbeKind
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
    role: ProbeRole
    canary_share: float
    canary: ProbeInfo
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[ProbeKind, str]] = ..., tensor_type: _Optional[_Union[TensorType, str]] = ..., layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., action: _Optional[_Union[ProbeAction, str]] = ..., threshold: _Optional[float] = ..., version: _Optional[str] = ..., tokens: _Optional[_Union[TokenSelector, _Mapping]] = ..., active_requests: _Optional[int] = ..., unloading: _Optional[bool] = ..., digest: _Optional[str] = ..., stateful: _Optional[bool] = ..., role: _Optional[_Union[ProbeRole, str]] = ..., canary_share: _Optional[float] = ..., canary: _Optional[_Union[ProbeInfo, _Mapping]] = ...) -> None: ...
