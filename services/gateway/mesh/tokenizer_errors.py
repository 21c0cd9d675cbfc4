"""What a failed call to the tokenizer service means to a request: the tokenizer's own refusal,
or TOKENIZER_LOST (retryable) when it is unreachable or died."""

from __future__ import annotations

import logging

import grpc

from shared import grpc_errors
from shared.errors import KvmeshError, Reason

log = logging.getLogger("kvmesh.gateway")


def tokenizer_lost(message: str) -> KvmeshError:
    return KvmeshError(Reason.TOKENIZER_LOST, message, retryable=True, retry_after_ms=1000)


def tokenizer_failure(error: grpc.RpcError) -> KvmeshError:
    """The tokenizer's own error, or TOKENIZER_LOST when it is unreachable or died: a status
    without a kvmesh reason that is UNAVAILABLE, CANCELLED or INTERNAL (grpcio's "Internal
    error from Core" when the peer vanished mid-call)."""
    failure = grpc_errors.from_rpc_error(error)
    lost_codes = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
    if error.code() in lost_codes and grpc_errors.rich_status_of(error) is None:
        log.warning("tokenizer lost", extra={"detail": failure.message})  # never to a client
        return tokenizer_lost("the tokenizer service is unreachable")
    return failure
