"""A client that stops reading its stream.

Flow control (HTTP/2 windows for gRPC, the socket buffer for HTTP) stops the gateway's writes
once the client's buffers are full, so what is held for a stalled client is bounded by those
buffers and the request's own output. A write that stays blocked past the stall timeout ends
the request: it is cancelled upstream (its KV blocks freed) and the stream closes with
CLIENT_STALLED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any

from shared.errors import KvmeshError, Reason

# asyncio's default high-water mark for a transport's buffer: past it, a write waits.
WRITE_HIGH_WATER = 64 * 1024


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


def writes_at_once(transport: asyncio.BaseTransport | None, size: int) -> bool:
    """Whether a write of `size` bytes cannot wait on the client: nothing is buffered for it,
    so the write leaves the buffer under its high-water mark and its drain returns at once.
    Most writes are such, and skip the stall timer (3 µs a chunk)."""
    if not isinstance(transport, asyncio.WriteTransport):
        return False
    return size < WRITE_HIGH_WATER and transport.get_write_buffer_size() == 0


def write_at_once(write: Coroutine[Any, Any, object]) -> bool:
    """Runs a write that `writes_at_once` admitted from outside its stream's task: it does
    not wait, so it runs to its end in one step; False if the connection closed."""
    try:
        write.send(None)
    except StopIteration:
        return True
    except ConnectionResetError:
        return False  # the task's own next write raises it
    write.close()  # waiting on a drain after all: the data went; the next write checks
    return True


def stalled_error(timeout_s: float) -> KvmeshError:
    return KvmeshError(
        Reason.CLIENT_STALLED,
        f"the client took no event for {timeout_s:g} s; the request was cancelled",
    )
