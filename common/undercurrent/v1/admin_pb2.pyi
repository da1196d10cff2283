from undercurrent.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadProbeRequest(_message.Message):
    __slots__ = ("path", "inline", "replace", "role", "canary_share")
    PATH_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CANARY_SHARE_FIELD_NUMBER: _ClassVar[int]
    path: str
    inline: InlineProbe
    replace: bool
    role: _types_pb2.ProbeRole
    canary_share: float
    def __init__(self, path: _Optional[str] = ..., inline: _Optional[_Union[InlineProbe, _Mapping]] = ..., replace: _Optional[bool] = ..., role: _Optional[_Union[_types_pb2.ProbeRole, str]] = ..., canary_share: _Optional[float] = ...) -> None: ...

class LoadProbeResponse(_message.Message):
    __slots__ = ("probe",)
    PROBE_FIELD_NUMBER: _ClassVar[int]
    probe: _types_pb2.ProbeInfo
    def __init__(self, probe: _Optional[_Union[_types_pb2.ProbeInfo, _Mapping]] = ...) -> None: ...

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
    probes: _containers.RepeatedCompositeFieldContainer[_types_pb2.ProbeInfo]
    def __init__(self, probes: _Optional[_Iterable[_Union[_types_pb2.ProbeInfo, _Mapping]]] = ...) -> None: ...

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

class PromoteProbeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PromoteProbeResponse(_message.Message):
    __slots__ = ("probe",)
    PROBE_FIELD_NUMBER: _ClassVar[int]
    probe: _types_pb2.ProbeInfo
    def __init__(self, probe: _Optional[_Union[_types_pb2.ProbeInfo, _Mapping]] = ...) -> None: ...

class RollBackProbeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RollBackProbeResponse(_message.Message):
    __slots__ = ("probe",)
    PROBE_FIELD_NUMBER: _ClassVar[int]
    probe: _types_pb2.ProbeInfo
    def __init__(self, probe: _Optional[_Union[_types_pb2.ProbeInfo, _Mapping]] = ...) -> None: ...
