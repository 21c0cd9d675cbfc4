"""A client that stops reading its stream.

Flow control (HTTP/2 windows for gRPC, the socket buffer for HTTP) stops the gateway's writes
once the client's buffers are full, so what is held for a stalled client is bounded by those
buffers and the request's own output. A write that stays blocked past the stall timeout ends
the request: it is cancelled upstream (its KV blocks freed) and the stream closes with
CLIENT_STALLED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from shared.errors import KvmeshError, Reason


class ClientStalled(Exception):
    """Thrown into a request's event generator: it ends as cancelled, reason client_stalled."""


async def write_or_stall(write: Awaitable[object], timeout_s: float) -> None:
    """Await one write; ClientStalled when it has not completed in `timeout_s` (0: wait)."""
    if timeout_s <= 0:
        await write
        return
    try:
        async with asyncio.timeout(timeout_s):  # a timer, not a task per write like wait_for
            await write
    except TimeoutError:
        raise ClientStalled(f"no event taken for {timeout_s:g} s") from None


def stalled_error(timeout_s: float) -> KvmeshError:
    return KvmeshError(
        Reason.CLIENT_STALLED,
        f"the client took no event for {timeout_s:g} s; the request was cancelled",
    )
