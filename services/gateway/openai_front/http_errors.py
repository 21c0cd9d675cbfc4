"""The HTTP front's errors as OpenAI error objects: the status per kvmesh reason, the shape
(`code` is the reason, plus `retryable`; `Retry-After` and `retry-after-ms` on retryable ones),
the middleware that turns every error into one, and the log filter for bytes that are not HTTP.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from shared.errors import KvmeshError, Reason

log = logging.getLogger("kvmesh.gateway.http")

# HTTP status per reason; the rest follow their gRPC code (see _http_status).
HTTP_STATUS = {
    Reason.MODEL_NOT_FOUND: 404,
    Reason.TRACE_NOT_FOUND: 404,
    Reason.UNAUTHENTICATED: 401,
    Reason.PERMISSION_DENIED: 403,
    Reason.RATE_LIMITED: 429,  # the tenant's own limits
    Reason.OVERLOADED: 503,  # the mesh's capacity: OpenAI's "engine overloaded"
    Reason.MODEL_NOT_READY: 503,
    Reason.WORKER_UNAVAILABLE: 503,
    Reason.WORKER_LOST: 503,
    Reason.TOKENIZER_LOST: 503,
    Reason.UNREACHABLE: 503,
    Reason.REQUEST_TOO_LARGE: 413,
    Reason.DEADLINE_EXCEEDED: 504,
    Reason.INVALID_OUTPUT: 500,
    Reason.EXECUTION_FAILED: 500,
    Reason.OUT_OF_MEMORY: 500,
    Reason.INTERNAL: 500,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def http_status(error: KvmeshError) -> int:
    return HTTP_STATUS.get(error.reason, 400)  # the rest are the caller's input


def error_object(error: KvmeshError) -> dict[str, Any]:
    status = http_status(error)
    return {
        "error": {
            "message": error.message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": None,
            "code": error.reason.value,
            "retryable": error.retryable,
        }
    }


def error_response(error: KvmeshError) -> web.Response:
    headers = {}
    if error.retryable:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1e3)))
        headers["retry-after-ms"] = str(error.retry_after_ms)
    return web.json_response(error_object(error), status=http_status(error), headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error, ours or aiohttp's (unknown path, wrong method), as an OpenAI error."""
    try:
        return await handler(request)
    except KvmeshError as error:
        return error_response(error)
    except (web.HTTPRequestEntityTooLarge, web.HTTPRequestHeaderFieldsTooLarge) as error:
        response = error_response(KvmeshError(Reason.REQUEST_TOO_LARGE, error.text or "too large"))
        response.set_status(error.status)  # 413 for a body, 431 for a header
        response.force_close()  # its body is never read
        return response
    except ConnectionError:  # the client left mid-body: nobody reads this, nothing to log
        log.debug("client left", extra={"path": request.path})
        gone = error_response(KvmeshError(Reason.INVALID_ARGUMENT, "the connection closed"))
        gone.force_close()  # aiohttp's write to the closed connection ends it quietly
        return gone
    except web.HTTPException as error:
        if error.status < 400:
            raise
        # Not a kvmesh reason's status: a path or method the API does not have.
        problem = f"{request.method} {request.path}: {error.reason}"
        response = error_response(KvmeshError(Reason.INVALID_ARGUMENT, problem))
        response.set_status(error.status)
        if error.status == web.HTTPRequestTimeout.status_code:
            response.force_close()  # the rest of that body is never read: let the client go
        return response
    except Exception:  # a bug: its traceback to the log, the API's error shape to the client
        log.exception("unexpected error in the HTTP front", extra={"path": request.path})
        return error_response(KvmeshError(Reason.INTERNAL, "internal error"))


def bad_http_in_one_line(record: logging.LogRecord) -> bool:
    """Bytes that are not HTTP get aiohttp's own plain 400 (no handler, no API runs); its log
    line says so at info level, without a traceback, whatever a client sends."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, BadHttpMessage):
        record.msg, record.args = f"not HTTP: {str(error.message).splitlines()[0]}", ()
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True
