from shared.pb.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("text", "chat", "model", "max_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: _common_pb2.Chat
    model: str
    max_tokens: int
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.Chat, _Mapping]] = ..., model: _Optional[str] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "finish", "piece_ids", "model")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    PIECE_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish: bool
    piece_ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish: _Optional[bool] = ..., piece_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text", "pieces")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    text: str
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, text: _Optional[str] = ..., pieces: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DetokenizeLane(_message.Message):
    __slots__ = ("lane", "request", "close", "traceparent")
    LANE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    lane: int
    request: DetokenizeRequest
    close: bool
    traceparent: str
    def __init__(self, lane: _Optional[int] = ..., request: _Optional[_Union[DetokenizeRequest, _Mapping]] = ..., close: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class DetokenizeLanesRequest(_message.Message):
    __slots__ = ("lanes",)
    LANES_FIELD_NUMBER: _ClassVar[int]
    lanes: _containers.RepeatedCompositeFieldContainer[DetokenizeLane]
    def __init__(self, lanes: _Optional[_Iterable[_Union[DetokenizeLane, _Mapping]]] = ...) -> None: ...

class DetokenizedLane(_message.Message):
    __slots__ = ("lane", "response", "error")
    LANE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    lane: int
    response: DetokenizeResponse
    error: _common_pb2.Error
    def __init__(self, lane: _Optional[int] = ..., response: _Optional[_Union[DetokenizeResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class DetokenizeLanesResponse(_message.Message):
    __slots__ = ("lanes",)
    LANES_FIELD_NUMBER: _ClassVar[int]
    lanes: _containers.RepeatedCompositeFieldContainer[DetokenizedLane]
    def __init__(self, lanes: _Optional[_Iterable[_Union[DetokenizedLane, _Mapping]]] = ...) -> None: ...

class TokenizerInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("vocab_size", "has_chat_template", "model_path")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    has_chat_template: bool
    model_path: str
    def __init__(self, vocab_size: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., model_path: _Optional[str] = ...) -> None: ...
