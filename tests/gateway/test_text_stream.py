"""Telling a dead tokenizer from a tokenizer that refused: only the first is TOKENIZER_LOST."""

from __future__ import annotations

import grpc
import pytest

from services.gateway.mesh.tokenizer_errors import tokenizer_failure
from shared import grpc_errors
from shared.errors import KvmeshError, Reason


def rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
        (grpc.StatusCode.CANCELLED, "Received RST_STREAM"),
        (grpc.StatusCode.INTERNAL, "Internal error from Core"),  # a write after the peer died
    ],
)
def test_a_vanished_tokenizer_is_tokenizer_lost_and_retryable(code, details) -> None:
    failure = tokenizer_failure(rpc_error(code, details))
    assert failure.reason is Reason.TOKENIZER_LOST and failure.retryable


def test_the_tokenizers_own_refusal_keeps_its_reason() -> None:
    own = KvmeshError(Reason.INVALID_ARGUMENT, "token id 99999 is outside the vocabulary")
    error = rpc_error(
        grpc.StatusCode.INVALID_ARGUMENT, own.message, grpc_errors.trailing_metadata(own)
    )
    failure = tokenizer_failure(error)
    assert failure.reason is Reason.INVALID_ARGUMENT and not failure.retryable
