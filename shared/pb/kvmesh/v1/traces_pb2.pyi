from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetTraceRequest(_message.Message):
    __slots__ = ("trace_id", "request_id")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    request_id: str
    def __init__(self, trace_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class SpanEvent(_message.Message):
    __slots__ = ("name", "time_unix_ns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    time_unix_ns: int
    def __init__(self, name: _Optional[str] = ..., time_unix_ns: _Optional[int] = ...) -> None: ...

class SpanRecord(_message.Message):
    __slots__ = ("span_id", "parent_span_id", "name", "service", "start_unix_ns", "end_unix_ns", "attributes", "events", "error")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_unix_ns: int
    end_unix_ns: int
    attributes: _containers.ScalarMap[str, str]
    events: _containers.RepeatedCompositeFieldContainer[SpanEvent]
    error: bool
    def __init__(self, span_id: _Optional[str] = ..., parent_span_id: _Optional[str] = ..., name: _Optional[str] = ..., service: _Optional[str] = ..., start_unix_ns: _Optional[int] = ..., end_unix_ns: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ..., events: _Optional[_Iterable[_Union[SpanEvent, _Mapping]]] = ..., error: _Optional[bool] = ...) -> None: ...

class RequestTiming(_message.Message):
    __slots__ = ("request_id", "trace_id", "model", "start_unix_ns", "e2e_ms", "ttft_ms", "tpot_ms", "queue_ms", "tokenize_ms", "prefill_ms", "decode_ms", "output_tokens", "outcome", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    trace_id: str
    model: str
    start_unix_ns: int
    e2e_ms: float
    ttft_ms: float
    tpot_ms: float
    queue_ms: float
    tokenize_ms: float
    prefill_ms: float
    decode_ms: float
    output_tokens: int
    outcome: str
    finish_reason: str
    def __init__(self, request_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., model: _Optional[str] = ..., start_unix_ns: _Optional[int] = ..., e2e_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., tokenize_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., output_tokens: _Optional[int] = ..., outcome: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("trace_id", "request_id", "spans", "timing")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    request_id: str
    spans: _containers.RepeatedCompositeFieldContainer[SpanRecord]
    timing: RequestTiming
    def __init__(self, trace_id: _Optional[str] = ..., request_id: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[SpanRecord, _Mapping]]] = ..., timing: _Optional[_Union[RequestTiming, _Mapping]] = ...) -> None: ...

class PhaseStatsRequest(_message.Message):
    __slots__ = ("window_s", "model")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    model: str
    def __init__(self, window_s: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...

class PhasePercentiles(_message.Message):
    __slots__ = ("phase", "count", "p50_ms", "p95_ms", "p99_ms", "max_ms")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P95_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    count: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    def __init__(self, phase: _Optional[str] = ..., count: _Optional[int] = ..., p50_ms: _Optional[float] = ..., p95_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., max_ms: _Optional[float] = ...) -> None: ...

class PhaseStats(_message.Message):
    __slots__ = ("requests", "phases", "rejected")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    requests: int
    phases: _containers.RepeatedCompositeFieldContainer[PhasePercentiles]
    rejected: int
    def __init__(self, requests: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[PhasePercentiles, _Mapping]]] = ..., rejected: _Optional[int] = ...) -> None: ...

class SlowestRequest(_message.Message):
    __slots__ = ("window_s", "model", "limit", "phase")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    model: str
    limit: int
    phase: str
    def __init__(self, window_s: _Optional[float] = ..., model: _Optional[str] = ..., limit: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class SlowestResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestTiming]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestTiming, _Mapping]]] = ...) -> None: ...
