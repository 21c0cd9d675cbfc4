from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AddBackendRequest(_message.Message):
    __slots__ = ("address", "model", "version", "task")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    address: str
    model: str
    version: str
    task: str
    def __init__(self, address: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., task: _Optional[str] = ...) -> None: ...

class AddBackendResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveBackendRequest(_message.Message):
    __slots__ = ("address", "drain_timeout_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    drain_timeout_s: float
    def __init__(self, address: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class RemoveBackendResponse(_message.Message):
    __slots__ = ("streams_left",)
    STREAMS_LEFT_FIELD_NUMBER: _ClassVar[int]
    streams_left: int
    def __init__(self, streams_left: _Optional[int] = ...) -> None: ...

class SetTrafficRequest(_message.Message):
    __slots__ = ("model", "percent")
    class PercentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    model: str
    percent: _containers.ScalarMap[str, float]
    def __init__(self, model: _Optional[str] = ..., percent: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SetTrafficResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
