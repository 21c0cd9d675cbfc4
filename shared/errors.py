"""Stable error reasons. Every error a client can see carries one, plus a retryable flag."""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    """Machine-readable reasons; names are part of the public contract and never change."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # a request or flag that is not the API's
    INVALID_SAMPLING_PARAMS = "INVALID_SAMPLING_PARAMS"  # a sampling field out of its range
    INVALID_SCHEMA = "INVALID_SCHEMA"  # a response format's schema, regex or grammar
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"  # prompt (+ max_tokens) past the model or a limit
    REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"  # the message's bytes, before any parsing of text
    EMPTY_PROMPT = "EMPTY_PROMPT"  # no token to start from
    TOKENIZER_UNAVAILABLE = "TOKENIZER_UNAVAILABLE"  # the model has none: send token ids
    TOKENIZER_LOST = "TOKENIZER_LOST"  # the tokenizer service stopped responding
    INVALID_MODEL = "INVALID_MODEL"  # an artifact that fails validation, a digest or a fixture
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"  # no model or version of that name is served
    TRACE_NOT_FOUND = "TRACE_NOT_FOUND"  # not received yet, evicted, or never traced
    MODEL_NOT_READY = "MODEL_NOT_READY"  # loading, draining, or no ready scheduler for it
    KV_CACHE_TOO_SMALL = "KV_CACHE_TOO_SMALL"  # the KV budget holds fewer than 2 blocks
    MODEL_DOES_NOT_FIT = "MODEL_DOES_NOT_FIT"  # its KV budget exceeds the memory left at load
    OVERLOADED = "OVERLOADED"  # every queue is past its watermark: retry after RetryInfo
    RATE_LIMITED = "RATE_LIMITED"  # the tenant's own limits, not the mesh's capacity
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no API key, or an unknown one, while auth is on
    PERMISSION_DENIED = "PERMISSION_DENIED"  # a valid key without the right (admin calls)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the request's deadline passed first
    WORKER_LOST = "WORKER_LOST"  # the scheduler or engine-worker serving it stopped responding
    # The model was served, and no replica is ready now (down, restarting, draining, its
    # circuit breaker open): retry after RetryInfo.
    WORKER_UNAVAILABLE = "WORKER_UNAVAILABLE"
    # The engine raised computing this request (a grammar, the sampler, non-finite logits): the
    # request ends, the rest of its batch goes on. Not retryable: it would fail again.
    EXECUTION_FAILED = "EXECUTION_FAILED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"  # the device (or host) ran out of memory computing it
    # A prefill/decode handover whose blocks did not arrive whole, under `--kv-load-failure
    # fail` (the default, `recompute`, computes them again instead).
    KV_HANDOVER_FAILED = "KV_HANDOVER_FAILED"
    UNREACHABLE = "UNREACHABLE"  # a service at a known address did not answer (not a model)
    CLIENT_STALLED = "CLIENT_STALLED"  # the client stopped reading its stream
    # A finished output that fails its response format's own check: a bug, never sent as valid.
    INVALID_OUTPUT = "INVALID_OUTPUT"
    INTERNAL = "INTERNAL"  # a bug: never expected, always logged with a traceback


class KvmeshError(Exception):
    """An error with a stable reason; `retryable` says whether the same call may succeed later."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        retryable: bool = False,
        retry_after_ms: int = 0,
    ) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.retryable = retryable
        self.retry_after_ms = retry_after_ms  # advice for a retry; 0 = none


class ModelValidationError(KvmeshError):
    """A model artifact that cannot be served; raised before any device memory is allocated."""

    def __init__(
        self,
        path: str,
        problem: str,
        *,
        tensor: str | None = None,
        expected: object = None,
        found: object = None,
    ) -> None:
        parts = [f"{path}: {problem}"]
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        if expected is not None or found is not None:
            parts.append(f"expected {expected}, found {found}")
        super().__init__(Reason.INVALID_MODEL, "; ".join(parts))
        self.path = path
        self.problem = problem
        self.tensor = tensor
        self.expected = expected
        self.found = found
