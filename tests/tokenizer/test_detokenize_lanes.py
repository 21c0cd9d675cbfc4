"""Every request's detokenizing on one shared stream: a real tokenizer server on loopback and the
gateway's client (DetokenizeLanes, TextStream)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvmesh.mesh.service_process import free_port
from services.gateway.mesh.detokenize_lanes import DetokenizeLanes
from services.gateway.request.text_stream import TextStream
from services.tokenizer import lanes as server_lanes
from services.tokenizer.server import LoadedTokenizer, TokenizerService
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, tokenizer_pb2_grpc
from shared.runtime.service import ServiceRuntime
from shared.runtime.tls import aio_channel
from shared.text_tokenizer import TextTokenizer

TEXTS = [
    "Emoji 👋🏽 and 🇫🇷, CJK 世界你好, accents héllo.",
    "def f(x):\n    return x ** 2  # square",
    "naïve café — “quotes” and emoji 🚀🌊",
    "Plain words, one after the other, and a number: 12345.",
]


@asynccontextmanager
async def tokenizer_server(tokenizer: TextTokenizer, port: int) -> AsyncIterator[ServiceRuntime]:
    runtime = ServiceRuntime("kvmesh.v1.Tokenizer", "127.0.0.1", port)
    service = TokenizerService(runtime, {"": LoadedTokenizer(tokenizer, "default")})
    runtime.add_servicer(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, service)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.server.stop(grace=None)


@asynccontextmanager
async def gateway_lanes(port: int) -> AsyncIterator[DetokenizeLanes]:
    channel = aio_channel(f"127.0.0.1:{port}")
    lanes = DetokenizeLanes(tokenizer_pb2_grpc.TokenizerStub(channel))
    try:
        yield lanes
    finally:
        await lanes.aclose()
        await channel.close()


@pytest.fixture
def messages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lanes in each message the tokenizer answered, in order."""
    seen: list[int] = []
    answer = server_lanes.Lanes.answer

    def counted(self, message):  # type: ignore[no-untyped-def]
        seen.append(len(message.lanes))
        return answer(self, message)

    monkeypatch.setattr(server_lanes.Lanes, "answer", counted)
    return seen


async def detokenized(stream: TextStream, ids: list[int], seed: int) -> list[str]:
    """`ids` pushed one to three at a time, the last push finishing the lane."""
    rng, pieces, start = random.Random(seed), [], 0
    while start < len(ids):
        end = min(len(ids), start + rng.randint(1, 3))
        pieces.append(await stream.push(ids[start:end], finish=end == len(ids)))
        start = end
        await asyncio.sleep(0)
    return pieces


async def test_many_requests_share_one_stream_and_each_gets_its_own_text(
    tokenizer: TextTokenizer, messages: list[int]
) -> None:
    port = free_port()
    requests = [TEXTS[i % len(TEXTS)] for i in range(32)]
    async with tokenizer_server(tokenizer, port) as runtime, gateway_lanes(port) as lanes:
        streams = [TextStream(lanes) for _ in requests]
        results = await asyncio.gather(
            *(
                detokenized(stream, tokenizer.encode(text), seed)
                for seed, (stream, text) in enumerate(zip(streams, requests, strict=True))
            )
        )
        assert runtime._inflight == 0  # every lane ended with its finish
    for text, pieces in zip(requests, results, strict=True):
        assert "".join(pieces) == text
        assert all("\ufffd" not in piece for piece in pieces)
    pushes = sum(len(pieces) for pieces in results)
    assert sum(messages) == pushes  # each push answered once
    assert len(messages) < pushes / 4  # most pushes shared a message with others


async def test_a_lane_fails_alone_and_a_cancelled_lane_is_forgotten(
    tokenizer: TextTokenizer,
) -> None:
    port = free_port()
    runtime = ServiceRuntime("kvmesh.v1.Tokenizer", "127.0.0.1", port)
    service = TokenizerService(runtime, {"smollm2": LoadedTokenizer(tokenizer, "default")})
    runtime.add_servicer(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, service)
    await runtime.start()
    try:
        async with gateway_lanes(port) as lanes:
            good, cancelled = TextStream(lanes, "smollm2"), TextStream(lanes, "smollm2")
            unknown = TextStream(lanes, "no-such-model")
            hello = tokenizer.encode("Hello there")
            assert await cancelled.push(hello[:1]) == "Hello"
            with pytest.raises(KvmeshError) as refused:
                await unknown.push(hello)
            assert refused.value.reason is Reason.MODEL_NOT_FOUND
            assert runtime._inflight == 1  # the failed lane is gone, the open one is counted
            cancelled.cancel()
            # Cancelled while its first push waits: the lane it opened is closed all the same.
            waiting = TextStream(lanes, "smollm2")
            first_push = asyncio.create_task(waiting.push(hello[:1]))
            await asyncio.sleep(0)  # queued, not yet answered
            first_push.cancel()
            waiting.cancel()
            logprob = common_pb2.TokenLogprobs(token_id=hello[0])
            assert await good.push(hello, finish=True, logprobs=[logprob]) == "Hello there"
            assert logprob.token_bytes == b"Hello"  # its own bytes, from the same answer
            assert runtime._inflight == 0  # both cancelled lanes were closed before that answer
    finally:
        await runtime.server.stop(grace=None)


async def test_a_tokenizer_restart_fails_the_lanes_on_its_stream_and_later_ones_open_anew(
    tokenizer: TextTokenizer,
) -> None:
    port = free_port()
    ids = tokenizer.encode("Hello there")
    async with gateway_lanes(port) as lanes:
        before = TextStream(lanes)
        async with tokenizer_server(tokenizer, port):
            assert await before.push(ids[:1]) == "Hello"
        with pytest.raises(KvmeshError) as lost:  # its lane's state went with the server
            await before.push(ids[1:])
        assert lost.value.reason is Reason.TOKENIZER_LOST and lost.value.retryable
        async with tokenizer_server(tokenizer, port):
            with pytest.raises(KvmeshError) as still_lost:
                await before.push(ids[1:], finish=True)
            assert still_lost.value.reason is Reason.TOKENIZER_LOST
            after = TextStream(lanes)
            assert await after.push(ids, finish=True) == "Hello there"
