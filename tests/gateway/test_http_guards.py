"""The HTTP front's guards on its real aiohttp server: a body held back past its timeout is 408
in the OpenAI error shape and the connection is let go within a second or two (aiohttp alone
would read on for 10 s); with auth on, no key is 401 before the body is waited for; one client
address holds at most its share of open requests; headers that never end are not waited for;
a body declared past the size limit is 413 before it is read; a header line past its bound
is 431 as JSON; a client leaving mid-body is not an error."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import types

import pytest

from kvmesh.mesh.service_process import free_port
from services.gateway.openai_front.server import OpenAIFront
from services.gateway.policy.policy import GatewayPolicy
from shared.tenants import ApiKeys

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"


async def front_on(
    keys: ApiKeys, body_timeout_s: float = 0.3, per_client: int = 0
) -> tuple[OpenAIFront, int]:
    policy = GatewayPolicy(
        api_keys=keys, body_timeout_s=body_timeout_s, max_http_per_client=per_client
    )
    front = OpenAIFront(types.SimpleNamespace(policy=policy), None)  # type: ignore[arg-type]
    port = free_port()
    await front.start("127.0.0.1", port)
    return front, port


async def held_body(port: int, head: bytes) -> tuple[bytes, float]:
    """Headers and 10 of 1000 body bytes, never more: the reply, and when the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(head + b"\r\n" + b"{" * 10)
    await writer.drain()
    reply = b""
    while chunk := await asyncio.wait_for(reader.read(65536), 15):
        reply += chunk
    writer.close()
    return reply, time.monotonic() - started


def status_and_error(reply: bytes) -> tuple[bytes, dict]:
    """A reply's status line and its OpenAI error object."""
    status, _, rest = reply.partition(b"\r\n")
    return status, json.loads(rest.partition(b"\r\n\r\n")[2])["error"]


async def test_a_held_back_body_is_408_and_the_connection_let_go() -> None:
    front, port = await front_on(ApiKeys())
    try:
        reply, closed_after = await held_body(port, HEAD)
    finally:
        await front.close()
    status, error = status_and_error(reply)
    assert b" 408 " in status
    assert "did not arrive within 0.3 s" in error["message"]
    assert closed_after < 3


async def test_with_auth_on_no_key_is_401_before_the_body_is_waited_for() -> None:
    front, port = await front_on(ApiKeys.from_env("acme=sk-acme"))
    try:
        reply, _ = await held_body(port, HEAD)
    finally:
        await front.close()
    assert b" 401 " in reply.partition(b"\r\n")[0]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "UNAUTHENTICATED"


async def test_one_client_holds_at_most_its_share_of_open_requests() -> None:
    front, port = await front_on(ApiKeys(), body_timeout_s=5.0, per_client=2)
    held = []
    try:
        for _ in range(2):  # two requests stuck reading their bodies
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEAD + b"\r\n" + b"{")
            await writer.drain()
            held.append((reader, writer))
        await asyncio.sleep(0.2)
        reply, _ = await held_body(port, HEAD)  # a third: refused at once
        assert b" 429 " in reply.partition(b"\r\n")[0]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "RATE_LIMITED"
    finally:
        for _, writer in held:
            writer.close()
        await front.close()


async def test_headers_that_never_end_are_not_waited_for() -> None:
    front, port = await front_on(ApiKeys())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing said
        assert time.monotonic() - started < 3
        writer.close()
    finally:
        await front.close()


async def test_a_body_declared_past_the_size_limit_is_413_at_once() -> None:
    front, port = await front_on(ApiKeys(), body_timeout_s=5.0)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n"
        reply, _ = await held_body(port, head)
    finally:
        await front.close()
    status, error = status_and_error(reply)
    assert b" 413 " in status  # a body waited for would have been 408, after 5 s
    assert error["code"] == "REQUEST_TOO_LARGE" and "10000000000 bytes" in error["message"]


async def test_a_client_leaving_mid_body_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    front, port = await front_on(ApiKeys(), body_timeout_s=5.0)
    try:
        for _ in range(3):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEAD + b"\r\n" + b'{"prompt": ')
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()
        await asyncio.sleep(0.5)
    finally:
        await front.close()
    errors = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert not errors, [record.getMessage() for record in errors]


async def test_a_header_past_the_bound_is_431_in_the_openai_shape() -> None:
    front, port = await front_on(ApiKeys())
    try:
        for size in (9_000, 60_000):  # past ours; past aiohttp's own default too
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
            writer.write(head)
            await writer.drain()
            reply = await asyncio.wait_for(reader.read(65536), 10)
            writer.close()
            status, error = status_and_error(reply)
            assert status.startswith(b"HTTP/1.1 431"), status
            assert error["code"] == "REQUEST_TOO_LARGE" and "8190" in error["message"]
    finally:
        await front.close()
