"""What every HTTP request passes before its handler: the key, then a bounded body read.

One place for auth, as gRPC's interceptors are for the gRPC port: with auth on, every path but
`/health` needs a valid key before anything else is looked at (an unknown model is 401 to a
client without a key, never 404), and `/metrics` needs an admin tenant's key or the scrape
token (`KVMESH_METRICS_TOKEN`). The body is then
read within `body_timeout_s`: a client that holds a partial body holds a connection that long,
no longer (408); one that declares more than the size limit is 413 at once. One client address
has at most `max_per_client` requests open at once (429). A header past `MAX_HEADER_BYTES` is
431, in the OpenAI error shape (aiohttp's parser is given room for it: server.py).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.gateway.request.call_context import HttpCall
from shared.errors import KvmeshError, Reason
from shared.runtime.metrics import is_scrape_token
from shared.tenants import ApiKeys

OPEN_PATHS = frozenset({"/health"})  # probes: no key, no body
# One header line (name and value): nginx's and aiohttp's own default bound (8 KiB).
MAX_HEADER_BYTES = 8190
# What aiohttp's parser is told to take: room past that, so a long header reaches the guards
# and gets their JSON 431; only one past this gets aiohttp's own plain-text 400.
PARSER_HEADER_BYTES = 64 * 1024
ADMIN_PATHS = frozenset({"/metrics"})  # every tenant's series
BODY_KEY = "kvmesh.body"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guards(api_keys: ApiKeys, body_timeout_s: float, max_per_client: int = 0) -> Any:
    open_requests: collections.Counter[str] = collections.Counter()

    @web.middleware
    async def guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
        longest = max((len(k) + len(v) for k, v in request.raw_headers), default=0)
        if longest > MAX_HEADER_BYTES:
            raise web.HTTPRequestHeaderFieldsTooLarge(
                text=f"a header line is {longest} bytes; this gateway takes at most "
                f"{MAX_HEADER_BYTES}"
            )
        client = request.remote or ""
        if max_per_client and open_requests[client] >= max_per_client:
            raise KvmeshError(
                Reason.RATE_LIMITED,
                f"this client address has {max_per_client} requests open already",
                retryable=True,
                retry_after_ms=1000,
            )
        open_requests[client] += 1
        try:
            return await _checked(request, handler)
        finally:
            open_requests[client] -= 1
            if not open_requests[client]:
                del open_requests[client]

    async def _checked(request: web.Request, handler: Handler) -> web.StreamResponse:
        scraping = request.path in ADMIN_PATHS and is_scrape_token(
            request.headers.get("Authorization", "")
        )
        if request.path not in OPEN_PATHS and not scraping:
            metadata = HttpCall(list(request.headers.items())).invocation_metadata()
            if request.path in ADMIN_PATHS:
                api_keys.require_admin(metadata, f"read {request.path}")
            else:
                api_keys.authenticate(metadata)
        if request.can_read_body:
            declared, most = request.content_length, request.client_max_size
            if declared is not None and declared > most:  # refused now, not once it arrived
                raise web.HTTPRequestEntityTooLarge(
                    max_size=most,
                    actual_size=declared,
                    text=f"the body is {declared} bytes; this gateway takes at most {most}",
                )
            try:
                request[BODY_KEY] = await asyncio.wait_for(request.read(), body_timeout_s)
            except TimeoutError:
                reason = f"the body did not arrive within {body_timeout_s:g} s"
                raise web.HTTPRequestTimeout(reason=reason) from None
        return await handler(request)

    return guarded


def body_of(request: web.Request) -> bytes:
    """The body the guards read (b"" for a request without one)."""
    body: bytes = request.get(BODY_KEY, b"")
    return body
