from shared.pb.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "priority", "cache_salt", "tenant", "tenant_weight", "group_id", "prefill_only", "handover")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    cache_salt: bytes
    tenant: str
    tenant_weight: float
    group_id: str
    prefill_only: bool
    handover: HandoverTicket
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[bytes] = ..., tenant: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., group_id: _Optional[str] = ..., prefill_only: _Optional[bool] = ..., handover: _Optional[_Union[HandoverTicket, _Mapping]] = ...) -> None: ...

class HandoverTicket(_message.Message):
    __slots__ = ("worker", "lease_id", "num_blocks", "lease_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    worker: str
    lease_id: str
    num_blocks: int
    lease_s: float
    def __init__(self, worker: _Optional[str] = ..., lease_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class SubmitEvent(_message.Message):
    __slots__ = ("accepted", "tokens", "finished", "failed")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    accepted: SubmitAccepted
    tokens: SubmitTokens
    finished: SubmitFinished
    failed: _common_pb2.Error
    def __init__(self, accepted: _Optional[_Union[SubmitAccepted, _Mapping]] = ..., tokens: _Optional[_Union[SubmitTokens, _Mapping]] = ..., finished: _Optional[_Union[SubmitFinished, _Mapping]] = ..., failed: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class SubmitAccepted(_message.Message):
    __slots__ = ("queue_position", "handover_blocks", "handover_bytes", "handover_seconds", "handover_outcome")
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    queue_position: int
    handover_blocks: int
    handover_bytes: int
    handover_seconds: float
    handover_outcome: str
    def __init__(self, queue_position: _Optional[int] = ..., handover_blocks: _Optional[int] = ..., handover_bytes: _Optional[int] = ..., handover_seconds: _Optional[float] = ..., handover_outcome: _Optional[str] = ...) -> None: ...

class SubmitTokens(_message.Message):
    __slots__ = ("token_ids", "logprobs", "first", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    first: FirstTokenTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., first: _Optional[_Union[FirstTokenTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class FirstTokenTimings(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "cached_tokens", "loaded_tokens")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    cached_tokens: int
    loaded_tokens: int
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ...) -> None: ...

class SubmitFinished(_message.Message):
    __slots__ = ("finish_reason", "cached_tokens", "queue_ms", "prefill_ms", "decode_ms", "draft_tokens", "accepted_draft_tokens", "loaded_tokens", "worker", "handover")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    cached_tokens: int
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    draft_tokens: int
    accepted_draft_tokens: int
    loaded_tokens: int
    worker: str
    handover: HandoverTicket
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., worker: _Optional[str] = ..., handover: _Optional[_Union[HandoverTicket, _Mapping]] = ...) -> None: ...

class SubmitLane(_message.Message):
    __slots__ = ("lane", "submit", "timeout_s", "trace_context", "cancel")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LANE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    lane: int
    submit: SubmitRequest
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    cancel: bool
    def __init__(self, lane: _Optional[int] = ..., submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class SubmitLanesRequest(_message.Message):
    __slots__ = ("lanes",)
    LANES_FIELD_NUMBER: _ClassVar[int]
    lanes: _containers.RepeatedCompositeFieldContainer[SubmitLane]
    def __init__(self, lanes: _Optional[_Iterable[_Union[SubmitLane, _Mapping]]] = ...) -> None: ...

class LaneEvent(_message.Message):
    __slots__ = ("lane", "event")
    LANE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    lane: int
    event: SubmitEvent
    def __init__(self, lane: _Optional[int] = ..., event: _Optional[_Union[SubmitEvent, _Mapping]] = ...) -> None: ...

class SubmitLanesResponse(_message.Message):
    __slots__ = ("events", "token_lanes", "token_ids")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LANES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LaneEvent]
    token_lanes: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, events: _Optional[_Iterable[_Union[LaneEvent, _Mapping]]] = ..., token_lanes: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SchedulerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("include_recent_frees",)
    INCLUDE_RECENT_FREES_FIELD_NUMBER: _ClassVar[int]
    include_recent_frees: bool
    def __init__(self, include_recent_frees: _Optional[bool] = ...) -> None: ...

class FreedRequest(_message.Message):
    __slots__ = ("request_id", "freed_unix_ns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    freed_unix_ns: int
    def __init__(self, request_id: _Optional[str] = ..., freed_unix_ns: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_free_blocks", "num_blocks", "num_preemptions", "prefix_hit_tokens", "num_expired_waiting", "num_expired_running", "num_aborted", "num_steps", "recent_frees", "worker_ready", "worker_compute_ms", "num_waiting_tokens", "queue_time_estimate_ms", "max_waiting", "slot_releases_s", "num_open_streams", "num_blocks_referenced", "prefix_query_tokens", "prefix_evictions", "num_failed_execution", "num_draft_tokens", "num_accepted_draft_tokens", "tenants")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FREES_FIELD_NUMBER: _ClassVar[int]
    WORKER_READY_FIELD_NUMBER: _ClassVar[int]
    WORKER_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_ESTIMATE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    SLOT_RELEASES_S_FIELD_NUMBER: _ClassVar[int]
    NUM_OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_REFERENCED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_EXECUTION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_hit_tokens: int
    num_expired_waiting: int
    num_expired_running: int
    num_aborted: int
    num_steps: int
    recent_frees: _containers.RepeatedCompositeFieldContainer[FreedRequest]
    worker_ready: bool
    worker_compute_ms: float
    num_waiting_tokens: int
    queue_time_estimate_ms: float
    max_waiting: int
    slot_releases_s: _containers.RepeatedScalarFieldContainer[float]
    num_open_streams: int
    num_blocks_referenced: int
    prefix_query_tokens: int
    prefix_evictions: int
    num_failed_execution: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantLoad]
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., num_expired_waiting: _Optional[int] = ..., num_expired_running: _Optional[int] = ..., num_aborted: _Optional[int] = ..., num_steps: _Optional[int] = ..., recent_frees: _Optional[_Iterable[_Union[FreedRequest, _Mapping]]] = ..., worker_ready: _Optional[bool] = ..., worker_compute_ms: _Optional[float] = ..., num_waiting_tokens: _Optional[int] = ..., queue_time_estimate_ms: _Optional[float] = ..., max_waiting: _Optional[int] = ..., slot_releases_s: _Optional[_Iterable[float]] = ..., num_open_streams: _Optional[int] = ..., num_blocks_referenced: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_evictions: _Optional[int] = ..., num_failed_execution: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantLoad, _Mapping]]] = ...) -> None: ...

class TenantLoad(_message.Message):
    __slots__ = ("tenant", "weight", "num_running", "num_waiting", "num_waiting_tokens", "num_blocks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_blocks: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class SchedulerModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
