"""The OpenAI load target against a server that closes pooled keep-alive connections."""

from __future__ import annotations

import asyncio
import re

import pytest

from loadtest.driver import LoadShape, run_load
from loadtest.targets import OpenAITarget
from loadtest.workload import RequestSpec

_STREAM = (
    b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n'
    b'data: {"choices":[{"text":"","finish_reason":"length"}],"usage":{"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


async def _closes_second_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    """Answers the first request on a connection and keeps it alive; on the second it hangs
    up unanswered, as a server whose keep-alive limit was reached does."""
    served = 0
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            await reader.readexactly(int(length.group(1)) if length else 0)
            if served == 1:
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (len(_STREAM), _STREAM)
            )
            await writer.drain()
            served += 1
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_a_closed_keep_alive_connection_loses_no_request() -> None:
    server = await asyncio.start_server(_closes_second_request, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    specs = [RequestSpec(index=i, prompt=[1, 2, 3], max_tokens=1, sampling={}) for i in range(6)]
    async with server, OpenAITarget(f"http://127.0.0.1:{port}/v1", model="m") as target:
        result = await run_load(target, specs, LoadShape(concurrency=1), progress=False)
    assert [r.outcome for r in result.records] == ["completed"] * 6
    assert sum(r.reconnects for r in result.records) >= 1  # the server did hang up on some
