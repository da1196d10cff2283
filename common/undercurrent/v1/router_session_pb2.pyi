from google.rpc import code_pb2 as _code_pb2
from undercurrent.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionHello(_message.Message):
    __slots__ = ("engine_id", "model", "accepts_replies")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_REPLIES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: _types_pb2.ModelInfo
    accepts_replies: bool
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[_Union[_types_pb2.ModelInfo, _Mapping]] = ..., accepts_replies: _Optional[bool] = ...) -> None: ...

class SessionBinding(_message.Message):
    __slots__ = ("probe", "failure_policy", "action", "digest")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    probe: str
    failure_policy: _types_pb2.FailurePolicy
    action: _types_pb2.ProbeAction
    digest: str
    def __init__(self, probe: _Optional[str] = ..., failure_policy: _Optional[_Union[_types_pb2.FailurePolicy, str]] = ..., action: _Optional[_Union[_types_pb2.ProbeAction, str]] = ..., digest: _Optional[str] = ...) -> None: ...

class RequestStart(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "state_reset", "incarnation", "bindings", "caller")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_RESET_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BINDINGS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    state_reset: bool
    incarnation: int
    bindings: _containers.RepeatedCompositeFieldContainer[SessionBinding]
    caller: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., state_reset: _Optional[bool] = ..., incarnation: _Optional[int] = ..., bindings: _Optional[_Iterable[_Union[SessionBinding, _Mapping]]] = ..., caller: _Optional[str] = ...) -> None: ...

class RequestEnd(_message.Message):
    __slots__ = ("request_id", "finish_reason", "incarnation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _types_pb2.FinishReason
    incarnation: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., incarnation: _Optional[int] = ...) -> None: ...

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
    batch: _types_pb2.ActivationBatch
    request_end: RequestEnd
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ..., request_start: _Optional[_Union[RequestStart, _Mapping]] = ..., batch: _Optional[_Union[_types_pb2.ActivationBatch, _Mapping]] = ..., request_end: _Optional[_Union[RequestEnd, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class RouterHello(_message.Message):
    __slots__ = ("router_id", "probes")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    probes: _containers.RepeatedCompositeFieldContainer[_types_pb2.ProbeInfo]
    def __init__(self, router_id: _Optional[str] = ..., probes: _Optional[_Iterable[_Union[_types_pb2.ProbeInfo, _Mapping]]] = ...) -> None: ...

class ProbeCatalog(_message.Message):
    __slots__ = ("probes",)
    PROBES_FIELD_NUMBER: _ClassVar[int]
    probes: _containers.RepeatedCompositeFieldContainer[_types_pb2.ProbeInfo]
    def __init__(self, probes: _Optional[_Iterable[_Union[_types_pb2.ProbeInfo, _Mapping]]] = ...) -> None: ...

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
    code: _code_pb2.Code
    message: str
    incarnation: int
    step: int
    def __init__(self, request_id: _Optional[str] = ..., probe: _Optional[str] = ..., code: _Optional[_Union[_code_pb2.Code, str]] = ..., message: _Optional[str] = ..., incarnation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SessionScores(_message.Message):
    __slots__ = ("probe_scores", "incarnation")
    PROBE_SCORES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    probe_scores: _types_pb2.ProbeScores
    incarnation: int
    def __init__(self, probe_scores: _Optional[_Union[_types_pb2.ProbeScores, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class SessionAbort(_message.Message):
    __slots__ = ("verdict", "incarnation")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    verdict: _types_pb2.Verdict
    incarnation: int
    def __init__(self, verdict: _Optional[_Union[_types_pb2.Verdict, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

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
    scores: SessionScores
    abort: SessionAbort
    ack: StepAck
    heartbeat: Heartbeat
    drain: Drain
    error: RequestError
    catalog: ProbeCatalog
    replies: SessionReplies
    def __init__(self, hello: _Optional[_Union[RouterHello, _Mapping]] = ..., scores: _Optional[_Union[SessionScores, _Mapping]] = ..., abort: _Optional[_Union[SessionAbort, _Mapping]] = ..., ack: _Optional[_Union[StepAck, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., catalog: _Optional[_Union[ProbeCatalog, _Mapping]] = ..., replies: _Optional[_Union[SessionReplies, _Mapping]] = ...) -> None: ...

class SessionReplies(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[SessionResponse]
    def __init__(self, messages: _Optional[_Iterable[_Union[SessionResponse, _Mapping]]] = ...) -> None: ...
