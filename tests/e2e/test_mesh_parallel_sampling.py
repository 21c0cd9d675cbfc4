"""n completions of one request through the real mesh: gRPC events by index, each completion
equal to the request sent alone with seed + index, the OpenAI front's choices and usage, and a
cancelled call that frees every completion's blocks."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import openai
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import (
    TERMINAL,
    assert_mesh_idle,
    chat_request,
    collect,
    output_ids,
    rich_error,
)

QUESTION = "Name a fruit and say what colour it is."
N = 4


def by_index(events: list[inference_pb2.GenerateEvent]) -> dict[int, list]:
    grouped: dict[int, list] = defaultdict(list)
    for event in events[1:]:  # after `accepted`
        grouped[event.index].append(event)
    return grouped


async def test_each_completion_equals_the_request_sent_alone_with_its_seed(mesh: Mesh) -> None:
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 31, "ignore_eos": True}
    request = chat_request(QUESTION, **sampling)
    request.n = N
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        events = await collect(stub, request)
        alone = []
        for index in range(N):
            single = chat_request(QUESTION, **{**sampling, "seed": 31 + index})
            alone.append(output_ids(await collect(stub, single)))
    assert events[0].WhichOneof("event") == "accepted"
    completions = by_index(events)
    assert sorted(completions) == list(range(N))
    for index, own in completions.items():
        names = [e.WhichOneof("event") for e in own]
        assert names[-2:] == ["usage", "completed"] and sum(n in TERMINAL for n in names) == 1
        assert output_ids(own) == alone[index]
        record = own[-1].completed.execution
        assert record.seed == 31 + index
        assert [a.attempt_id for a in record.attempts] == [
            f"{events[0].accepted.request_id}[{index}]#1"
        ]
        assert own[-1].completed.usage.completion_tokens == 8
    assert len({tuple(output_ids(own)) for own in completions.values()}) > 1


async def test_openai_n_choices_stream_the_same_as_the_whole_answer(mesh: Mesh) -> None:
    async with openai.AsyncOpenAI(
        base_url=mesh.http_url, api_key="unused", max_retries=0
    ) as client:
        model = (await client.models.list()).data[0].id
        ask = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 7,
            "n": 3,
            "extra_body": {"ignore_eos": True},
        }
        whole = await client.chat.completions.create(**ask)
        stream = await client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        texts: dict[int, str] = defaultdict(str)
        finishes: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert sorted(finishes) == [0, 1, 2]
    assert whole.usage.completion_tokens == 3 * 8  # summed over the choices
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens  # the prompt counted once


async def test_cancelling_the_call_frees_every_completion(mesh: Mesh) -> None:
    request = chat_request(QUESTION, max_tokens=400, temperature=1.0, ignore_eos=True)
    request.n = N
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(request)
        seen: set[int] = set()
        while len(seen) < N:  # every completion is running
            event = await call.read()
            if event.WhichOneof("event") == "delta":
                seen.add(event.index)
        call.cancel()
    await asyncio.sleep(0.1)
    await assert_mesh_idle(mesh)


async def test_too_many_completions_is_an_invalid_argument(mesh: Mesh) -> None:
    request = chat_request(QUESTION, max_tokens=4)
    request.n = 17
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            await collect(inference_pb2_grpc.InferenceStub(channel), request)
    error = rich_error(raised.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.reason == "INVALID_ARGUMENT"
    assert not error.retryable
