from shared.pb.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbedRequest(_message.Message):
    __slots__ = ("model", "inputs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbedInput]
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.EmbedInput, _Mapping]]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "model", "model_version", "prompt_tokens")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Embedding]
    model: str
    model_version: str
    prompt_tokens: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[_common_pb2.Embedding, _Mapping]]] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "token_ids", "sampling", "stop", "timeout_ms", "request_id", "priority", "n", "user", "tool_choice")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: _common_pb2.Chat
    token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    timeout_ms: int
    request_id: str
    priority: int
    n: int
    user: str
    tool_choice: ToolChoice
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.Chat, _Mapping]] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., timeout_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., n: _Optional[int] = ..., user: _Optional[str] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function", "single_call")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_AUTO: _ClassVar[ToolChoice.Mode]
        MODE_NONE: _ClassVar[ToolChoice.Mode]
        MODE_REQUIRED: _ClassVar[ToolChoice.Mode]
        MODE_FUNCTION: _ClassVar[ToolChoice.Mode]
    MODE_AUTO: ToolChoice.Mode
    MODE_NONE: ToolChoice.Mode
    MODE_REQUIRED: ToolChoice.Mode
    MODE_FUNCTION: ToolChoice.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    SINGLE_CALL_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoice.Mode
    function: str
    single_call: bool
    def __init__(self, mode: _Optional[_Union[ToolChoice.Mode, str]] = ..., function: _Optional[str] = ..., single_call: _Optional[bool] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("accepted", "delta", "usage", "completed", "cancelled", "failed", "index")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    delta: Delta
    usage: Usage
    completed: Completed
    cancelled: Cancelled
    failed: Failed
    index: int
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., completed: _Optional[_Union[Completed, _Mapping]] = ..., cancelled: _Optional[_Union[Cancelled, _Mapping]] = ..., failed: _Optional[_Union[Failed, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id", "queue_position", "prompt_tokens", "model", "routing", "trace_id", "model_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    queue_position: int
    prompt_tokens: int
    model: str
    routing: RoutingDecision
    trace_id: str
    model_version: str
    def __init__(self, request_id: _Optional[str] = ..., queue_position: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., model: _Optional[str] = ..., routing: _Optional[_Union[RoutingDecision, _Mapping]] = ..., trace_id: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class RoutingDecision(_message.Message):
    __slots__ = ("scheduler", "matched_blocks", "matched_tokens", "reason")
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    scheduler: str
    matched_blocks: int
    matched_tokens: int
    reason: str
    def __init__(self, scheduler: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "first_token", "tool_calls", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    first_token: bool
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., first_token: _Optional[bool] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "decode_ms", "total_ms", "ttft_ms", "draft_tokens", "accepted_draft_tokens", "loaded_tokens")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float
    ttft_ms: float
    draft_tokens: int
    accepted_draft_tokens: int
    loaded_tokens: int
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ...) -> None: ...

class ExecutionRecord(_message.Message):
    __slots__ = ("model_name", "model_version", "artifact_digest", "backend", "dtype", "sampling", "seed", "scheduler", "routing", "tenant", "attempts", "runtime", "device", "threads", "tokenizer_digest", "stop", "prepared_id", "worker", "handover")
    class RuntimeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PREPARED_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    artifact_digest: str
    backend: str
    dtype: str
    sampling: _common_pb2.SamplingParams
    seed: int
    scheduler: str
    routing: RoutingDecision
    tenant: str
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    runtime: _containers.ScalarMap[str, str]
    device: str
    threads: int
    tokenizer_digest: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    prepared_id: str
    worker: str
    handover: Handover
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., artifact_digest: _Optional[str] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., scheduler: _Optional[str] = ..., routing: _Optional[_Union[RoutingDecision, _Mapping]] = ..., tenant: _Optional[str] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., runtime: _Optional[_Mapping[str, str]] = ..., device: _Optional[str] = ..., threads: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., prepared_id: _Optional[str] = ..., worker: _Optional[str] = ..., handover: _Optional[_Union[Handover, _Mapping]] = ...) -> None: ...

class Handover(_message.Message):
    __slots__ = ("prefill_scheduler", "prefill_worker", "blocks", "bytes", "seconds", "outcome")
    PREFILL_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    prefill_scheduler: str
    prefill_worker: str
    blocks: int
    bytes: int
    seconds: float
    outcome: str
    def __init__(self, prefill_scheduler: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., outcome: _Optional[str] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("attempt_id", "scheduler", "error_reason")
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    attempt_id: str
    scheduler: str
    error_reason: str
    def __init__(self, attempt_id: _Optional[str] = ..., scheduler: _Optional[str] = ..., error_reason: _Optional[str] = ...) -> None: ...

class Completed(_message.Message):
    __slots__ = ("finish_reason", "stop_string", "usage", "timings", "execution", "tool_calls")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stop_string: str
    usage: Usage
    timings: Timings
    execution: ExecutionRecord
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_string: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., execution: _Optional[_Union[ExecutionRecord, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class Cancelled(_message.Message):
    __slots__ = ("reason", "usage")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    usage: Usage
    def __init__(self, reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Failed(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.Error
    def __init__(self, error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

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

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "versions")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInfo]
    versions: _containers.RepeatedCompositeFieldContainer[ModelVersionStatus]
    def __init__(self, models: _Optional[_Iterable[_Union[_common_pb2.ModelInfo, _Mapping]]] = ..., versions: _Optional[_Iterable[_Union[ModelVersionStatus, _Mapping]]] = ...) -> None: ...

class ModelVersionStatus(_message.Message):
    __slots__ = ("name", "version", "state", "replicas", "ready_replicas", "traffic_percent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    READY_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_PERCENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    state: str
    replicas: int
    ready_replicas: int
    traffic_percent: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[str] = ..., replicas: _Optional[int] = ..., ready_replicas: _Optional[int] = ..., traffic_percent: _Optional[float] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: _common_pb2.Chat
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.Chat, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("count", "max_model_len", "max_output_tokens")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    count: int
    max_model_len: int
    max_output_tokens: int
    def __init__(self, count: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_output_tokens: _Optional[int] = ...) -> None: ...
