"""KvmeshError <-> gRPC status in the rich error model (google.rpc.Status + ErrorInfo).

Every error a client sees carries ErrorInfo{reason, domain "kvmesh.dev", metadata retryable},
plus RetryInfo when a retry may help. The same facts travel inside streams as `Error` messages.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2

DOMAIN = "kvmesh.dev"
_DETAILS_KEY = "grpc-status-details-bin"

STATUS_CODES: dict[Reason, grpc.StatusCode] = {
    Reason.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.INVALID_SAMPLING_PARAMS: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.INVALID_SCHEMA: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.PROMPT_TOO_LONG: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.REQUEST_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.EMPTY_PROMPT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.TOKENIZER_UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.TOKENIZER_LOST: grpc.StatusCode.UNAVAILABLE,
    Reason.INVALID_MODEL: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.MODEL_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.TRACE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.MODEL_NOT_READY: grpc.StatusCode.UNAVAILABLE,
    Reason.WORKER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.KV_CACHE_TOO_SMALL: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.MODEL_DOES_NOT_FIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Reason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.WORKER_LOST: grpc.StatusCode.UNAVAILABLE,
    Reason.EXECUTION_FAILED: grpc.StatusCode.INTERNAL,
    Reason.OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.UNREACHABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.KV_HANDOVER_FAILED: grpc.StatusCode.UNAVAILABLE,
    Reason.CLIENT_STALLED: grpc.StatusCode.CANCELLED,
    Reason.INVALID_OUTPUT: grpc.StatusCode.INTERNAL,
    Reason.INTERNAL: grpc.StatusCode.INTERNAL,
}


def status_code(error: KvmeshError) -> grpc.StatusCode:
    return STATUS_CODES[error.reason]


def to_rpc_status(error: KvmeshError) -> status_pb2.Status:
    code = status_code(error).value[0]
    info = error_details_pb2.ErrorInfo(
        reason=error.reason.value,
        domain=DOMAIN,
        metadata={"retryable": "true" if error.retryable else "false"},
    )
    details = [_pack(info)]
    if error.retryable:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(code=code, message=error.message, details=details)


def trailing_metadata(error: KvmeshError) -> tuple[tuple[str, str | bytes], ...]:
    return ((_DETAILS_KEY, to_rpc_status(error).SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, error: KvmeshError) -> None:
    """End the call with the rich status; never returns (raises inside grpc)."""
    await context.abort(status_code(error), error.message, trailing_metadata(error))


def to_pb(error: KvmeshError) -> common_pb2.Error:
    return common_pb2.Error(
        reason=error.reason.value,
        message=error.message,
        retryable=error.retryable,
        retry_after_ms=error.retry_after_ms,
        grpc_code=status_code(error).value[0],
    )


def from_pb(message: common_pb2.Error) -> KvmeshError:
    return KvmeshError(
        _reason(message.reason),
        message.message,
        retryable=message.retryable,
        retry_after_ms=message.retry_after_ms,
    )


def from_rpc_error(error: grpc.RpcError) -> KvmeshError:
    """A downstream failure as a KvmeshError: its own ErrorInfo when it sent one, else a reason
    inferred from the status code (a peer that died sends none)."""
    status = rich_status_of(error)
    if status is not None:
        info = error_details_pb2.ErrorInfo()
        retry = error_details_pb2.RetryInfo()
        has_info = False
        for detail in status.details:
            if detail.Is(info.DESCRIPTOR):
                has_info = detail.Unpack(info) and info.domain == DOMAIN
            elif detail.Is(retry.DESCRIPTOR):
                detail.Unpack(retry)
        if has_info:
            return KvmeshError(
                _reason(info.reason),
                status.message,
                retryable=info.metadata.get("retryable") == "true",
                retry_after_ms=retry.retry_delay.ToMilliseconds(),
            )
    # Sync errors are grpc.Call; grpc.aio.AioRpcError has the same methods without the base.
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KvmeshError(Reason.DEADLINE_EXCEEDED, details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return KvmeshError(Reason.MODEL_NOT_READY, details, retryable=True, retry_after_ms=500)
    return KvmeshError(Reason.INTERNAL, f"{code}: {details}")


def from_call_to(error: grpc.RpcError, service: str, address: str) -> KvmeshError:
    """A client's view of a failed call to `service` at `address`: the service's own reason,
    or UNREACHABLE naming both when nothing answered there (never MODEL_NOT_READY: no model
    was asked)."""
    code = error.code() if hasattr(error, "code") else None
    if code == grpc.StatusCode.UNAVAILABLE and rich_status_of(error) is None:
        return KvmeshError(
            Reason.UNREACHABLE,
            f"no {service} answers at {address} (is the mesh up? `kvmesh up` prints its addresses)",
            retryable=True,
            retry_after_ms=1000,
        )
    return from_rpc_error(error)


def rich_status_of(error: grpc.RpcError) -> status_pb2.Status | None:
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == _DETAILS_KEY:
            status = status_pb2.Status()
            status.ParseFromString(value)
            return status
    return None


def _pack(message: error_details_pb2.ErrorInfo | error_details_pb2.RetryInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _reason(name: str) -> Reason:
    try:
        return Reason(name)
    except ValueError:
        return Reason.INTERNAL
