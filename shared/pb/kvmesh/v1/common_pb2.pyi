from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ResponseFormat(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "logprobs", "response_format", "logit_bias", "disable_speculation", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    response_format: ResponseFormat
    logit_bias: _containers.ScalarMap[int, float]
    disable_speculation: bool
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., disable_speculation: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "num_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    num_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("reason", "message", "retryable", "retry_after_ms", "grpc_code")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    GRPC_CODE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    retryable: bool
    retry_after_ms: int
    grpc_code: int
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ..., retry_after_ms: _Optional[int] = ..., grpc_code: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "artifact_digest", "artifact_sha256", "artifact_path", "architecture", "num_parameters", "dtype", "quantization", "backend", "max_model_len", "kv_block_size", "kv_blocks", "kv_cache_bytes", "kv_bytes_per_token", "load_seconds", "warmup_seconds", "vocab_size", "eos_token_ids", "aliases", "default_sampling", "task", "embedding_dimensions", "runtime", "device", "threads", "tokenizer_digest", "cuda_graphs", "prepared_id", "serving_role", "max_step_tokens", "max_step_sampled_rows", "sliding_window", "kv_window_blocks")
    class ArtifactSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RuntimeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CudaGraphsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_ID_FIELD_NUMBER: _ClassVar[int]
    SERVING_ROLE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_SAMPLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    artifact_digest: str
    artifact_sha256: _containers.ScalarMap[str, str]
    artifact_path: str
    architecture: str
    num_parameters: int
    dtype: str
    quantization: str
    backend: str
    max_model_len: int
    kv_block_size: int
    kv_blocks: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    load_seconds: float
    warmup_seconds: float
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    aliases: _containers.RepeatedScalarFieldContainer[str]
    default_sampling: SamplingParams
    task: str
    embedding_dimensions: int
    runtime: _containers.ScalarMap[str, str]
    device: str
    threads: int
    tokenizer_digest: str
    cuda_graphs: _containers.ScalarMap[str, str]
    prepared_id: str
    serving_role: str
    max_step_tokens: int
    max_step_sampled_rows: int
    sliding_window: int
    kv_window_blocks: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., artifact_digest: _Optional[str] = ..., artifact_sha256: _Optional[_Mapping[str, str]] = ..., artifact_path: _Optional[str] = ..., architecture: _Optional[str] = ..., num_parameters: _Optional[int] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., backend: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., load_seconds: _Optional[float] = ..., warmup_seconds: _Optional[float] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., aliases: _Optional[_Iterable[str]] = ..., default_sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., task: _Optional[str] = ..., embedding_dimensions: _Optional[int] = ..., runtime: _Optional[_Mapping[str, str]] = ..., device: _Optional[str] = ..., threads: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ..., cuda_graphs: _Optional[_Mapping[str, str]] = ..., prepared_id: _Optional[str] = ..., serving_role: _Optional[str] = ..., max_step_tokens: _Optional[int] = ..., max_step_sampled_rows: _Optional[int] = ..., sliding_window: _Optional[int] = ..., kv_window_blocks: _Optional[int] = ...) -> None: ...
