"""The OpenAI load target against a server that drops connections before answering."""

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


def _drops_every_other_connection():
    """A server that hangs up unanswered on every other connection it accepts (as one does
    when its keep-alive timer or connection limit ran out), and answers on the rest."""
    accepted = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if accepted % 2 == 1:
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(_STREAM), _STREAM)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


@pytest.mark.asyncio
async def test_a_connection_dropped_before_an_answer_loses_no_request() -> None:
    server = await asyncio.start_server(_drops_every_other_connection(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    specs = [RequestSpec(index=i, prompt=[1, 2, 3], max_tokens=1, sampling={}) for i in range(6)]
    async with server, OpenAITarget(f"http://127.0.0.1:{port}/v1", model="m") as target:
        result = await run_load(target, specs, LoadShape(concurrency=1), progress=False)
    assert [r.outcome for r in result.records] == ["completed"] * 6
    # Each request's first connection was dropped; its resend on a fresh one was answered.
    assert [r.reconnects for r in result.records] == [1] * 6
