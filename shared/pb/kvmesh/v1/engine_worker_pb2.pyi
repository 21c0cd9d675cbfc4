from shared.pb.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbedInputs(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbedInput]
    def __init__(self, inputs: _Optional[_Iterable[_Union[_common_pb2.EmbedInput, _Mapping]]] = ...) -> None: ...

class EmbedVectors(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[_common_pb2.Embedding, _Mapping]]] = ...) -> None: ...

class EmbedderModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareFormatResponse(_message.Message):
    __slots__ = ("compile_seconds",)
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    compile_seconds: float
    def __init__(self, compile_seconds: _Optional[float] = ...) -> None: ...

class NewRequestPlan(_message.Message):
    __slots__ = ("request_id", "token_ids", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "sampling", "prompt_len", "load_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: _common_pb2.SamplingParams
    prompt_len: int
    load_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_len: _Optional[int] = ..., load_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class RunningColumns(_message.Message):
    __slots__ = ("request_ids", "num_scheduled_tokens", "new_block_counts", "new_block_ids", "draft_counts", "draft_token_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_block_counts: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., new_block_counts: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillTrace(_message.Message):
    __slots__ = ("request_id", "traceparent", "chunk_tokens", "cached_tokens", "start_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    traceparent: str
    chunk_tokens: int
    cached_tokens: int
    start_position: int
    def __init__(self, request_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., start_position: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "finished_request_ids", "prefill_traces", "running", "block_copies", "block_writes")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TRACES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_WRITES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequestPlan]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    prefill_traces: _containers.RepeatedCompositeFieldContainer[PrefillTrace]
    running: RunningColumns
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    block_writes: _containers.RepeatedCompositeFieldContainer[BlockWrite]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequestPlan, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., prefill_traces: _Optional[_Iterable[_Union[PrefillTrace, _Mapping]]] = ..., running: _Optional[_Union[RunningColumns, _Mapping]] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., block_writes: _Optional[_Iterable[_Union[BlockWrite, _Mapping]]] = ...) -> None: ...

class BlockWrite(_message.Message):
    __slots__ = ("block_id", "block_hash", "token_ids")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_id: _Optional[int] = ..., block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("source", "destination")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    source: int
    destination: int
    def __init__(self, source: _Optional[int] = ..., destination: _Optional[int] = ...) -> None: ...

class SampledColumns(_message.Message):
    __slots__ = ("request_ids", "token_ids", "num_accepted_drafts", "logprob_rows", "logprobs", "draft_logprobs")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted_drafts: _containers.RepeatedScalarFieldContainer[int]
    logprob_rows: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    draft_logprobs: _containers.RepeatedCompositeFieldContainer[DraftLogprobs]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_accepted_drafts: _Optional[_Iterable[int]] = ..., logprob_rows: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., draft_logprobs: _Optional[_Iterable[_Union[DraftLogprobs, _Mapping]]] = ...) -> None: ...

class DraftLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "compute_ms", "failed", "load_failures", "sampled", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    compute_ms: float
    failed: _containers.RepeatedCompositeFieldContainer[FailedRequest]
    load_failures: _containers.RepeatedCompositeFieldContainer[LoadFailure]
    sampled: SampledColumns
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., compute_ms: _Optional[float] = ..., failed: _Optional[_Iterable[_Union[FailedRequest, _Mapping]]] = ..., load_failures: _Optional[_Iterable[_Union[LoadFailure, _Mapping]]] = ..., sampled: _Optional[_Union[SampledColumns, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "first_position", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_position: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_position: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class LoadFailure(_message.Message):
    __slots__ = ("request_id", "num_computed_tokens", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_computed_tokens: int
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class FailedRequest(_message.Message):
    __slots__ = ("request_id", "reason", "error_type")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    error_type: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., error_type: _Optional[str] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "kv_tiers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    kv_tiers: KVTierInfo
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., kv_tiers: _Optional[_Union[KVTierInfo, _Mapping]] = ...) -> None: ...

class KVTierInfo(_message.Message):
    __slots__ = ("tiers", "write", "load_min_tokens")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    LOAD_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    write: str
    load_min_tokens: int
    def __init__(self, tiers: _Optional[_Iterable[str]] = ..., write: _Optional[str] = ..., load_min_tokens: _Optional[int] = ...) -> None: ...

class BlockLookup(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockLookupResult(_message.Message):
    __slots__ = ("num_leading",)
    NUM_LEADING_FIELD_NUMBER: _ClassVar[int]
    num_leading: int
    def __init__(self, num_leading: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("source_worker", "lease_id", "block_hashes", "timeout_s")
    SOURCE_WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    source_worker: str
    lease_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, source_worker: _Optional[str] = ..., lease_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PullResult(_message.Message):
    __slots__ = ("num_blocks", "bytes", "seconds", "outcome")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes: int
    seconds: float
    outcome: str
    def __init__(self, num_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., outcome: _Optional[str] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("lease_id", "num_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    num_blocks: int
    def __init__(self, lease_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class BlockRecord(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: bytes
    def __init__(self, record: _Optional[bytes] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("seconds",)
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    def __init__(self, seconds: _Optional[float] = ...) -> None: ...
