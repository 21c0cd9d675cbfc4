from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DeployRequest(_message.Message):
    __slots__ = ("model", "version", "canary_percent")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_PERCENT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    canary_percent: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., canary_percent: _Optional[float] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class RolloutEvent(_message.Message):
    __slots__ = ("message", "traffic", "done")
    class TrafficEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    message: str
    traffic: _containers.ScalarMap[str, float]
    done: bool
    def __init__(self, message: _Optional[str] = ..., traffic: _Optional[_Mapping[str, float]] = ..., done: _Optional[bool] = ...) -> None: ...
