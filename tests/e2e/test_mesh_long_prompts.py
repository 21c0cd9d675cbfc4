"""A prompt far past the context is refused without holding anyone: three 3.9 MB prompts sent
with a normal chat leave the chat's TTFT within 2x of alone (plus the time to take 11.7 MB off
the wire), and each is PROMPT_TOO_LONG; so do 1.3 MB chats of random symbols with no space,
too few bytes for the byte count to refuse, refused within 1 s."""

from __future__ import annotations

import asyncio
import random
import statistics
import string
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import rich_error

T = TypeVar("T")
HUGE = "word " * 780_000  # 3.9 MB, under the 4 MiB request limit
_rng = random.Random(0)
SYMBOLS = "".join(_rng.choice(string.ascii_letters + string.punctuation) for _ in range(1_300_000))


def chat_request(index: int) -> inference_pb2.GenerateRequest:
    message = common_pb2.ChatMessage(role="user", content=f"Say hello to friend number {index}.")
    return inference_pb2.GenerateRequest(
        chat=common_pb2.Chat(messages=[message]),
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
    )


async def ttft(stub: inference_pb2_grpc.InferenceStub, index: int) -> float:
    started = time.monotonic()
    async for event in stub.Generate(chat_request(index), timeout=60):
        if event.WhichOneof("event") == "delta":
            return time.monotonic() - started
    raise AssertionError("no token")


async def refused_reason(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest | None = None,
) -> str:
    request = request or inference_pb2.GenerateRequest(text=HUGE)
    try:
        async for _event in stub.Generate(request, timeout=60):
            pass
    except grpc.aio.AioRpcError as error:
        return rich_error(error).reason
    return "accepted"


async def ttfts_alone_and_beside(
    mesh: Mesh, refusals: Callable[[inference_pb2_grpc.InferenceStub], list[Awaitable[T]]]
) -> tuple[list[float], list[float], list[T]]:
    """A normal chat's TTFT five times alone, then five times beside `refusals`: both lists,
    and what the refusals returned."""
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await ttft(stub, 0)  # warm
        alone = [await ttft(stub, index) for index in range(1, 6)]
        beside, refused = [], []
        for index in range(6, 11):
            chat, *results = await asyncio.gather(ttft(stub, index), *refusals(stub))
            beside.append(chat)
            refused += results
    return alone, beside, refused


async def test_huge_prompts_are_refused_without_holding_a_normal_chat(mesh: Mesh) -> None:
    alone, beside, reasons = await ttfts_alone_and_beside(
        mesh, lambda stub: [refused_reason(stub) for _ in range(3)]
    )
    assert set(reasons) == {"PROMPT_TOO_LONG"}
    # 0.1 s for the bytes: the chat's TTFT alone (~50 ms on a 2-core Zen 4) leaves 2x no room.
    assert statistics.median(beside) <= 2 * statistics.median(alone) + 0.1, (alone, beside)


async def test_symbols_with_no_space_are_refused_at_once_without_holding_a_normal_chat(
    mesh: Mesh,
) -> None:
    message = common_pb2.ChatMessage(role="user", content=SYMBOLS)
    symbols = inference_pb2.GenerateRequest(chat=common_pb2.Chat(messages=[message]))

    async def timed_refusal(stub: inference_pb2_grpc.InferenceStub) -> float:
        started = time.monotonic()
        assert await refused_reason(stub, symbols) == "PROMPT_TOO_LONG"
        return time.monotonic() - started

    alone, beside, refused_in = await ttfts_alone_and_beside(
        mesh, lambda stub: [timed_refusal(stub) for _ in range(2)]
    )
    assert max(refused_in) < 1.0, refused_in  # tokenized whole, each took 2.5 s of CPU
    assert statistics.median(beside) <= 2 * statistics.median(alone) + 0.1, (alone, beside)
