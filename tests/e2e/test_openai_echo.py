"""`echo` with `logprobs` on /v1/completions (how lm-eval scores text), and prompt_logprobs on
the gRPC API, on the shared mesh."""

from __future__ import annotations

import asyncio
import json

import grpc
import openai

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.test_openai_tokenize import post

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def scored(mesh: Mesh, body: dict) -> dict:
    status, answer = post(mesh, "/v1/completions", body)
    assert status == 200, answer
    return answer


async def test_echo_scores_the_prompt_without_generating(mesh: Mesh) -> None:
    _, tokenized = await asyncio.to_thread(post, mesh, "/tokenize", {"prompt": PROMPT})
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    answer = await asyncio.to_thread(scored, mesh, body)
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == PROMPT and "".join(logprobs["tokens"]) == PROMPT
    assert len(logprobs["tokens"]) == tokenized["count"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for value, top in zip(
        logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True
    ):
        assert value <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) >= value - 1e-5  # the best alternative is at least as likely
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == tokenized["count"]
    # "Paris" after "The capital of France is" is far likelier than chance.
    paris = logprobs["tokens"].index(" Paris")
    assert logprobs["token_logprobs"][paris] > -3

    # The same prompt as token ids, with a completion after it: the prompt scored alike
    # (computed whole, no prefix-cache hit), the completion's tokens after it.
    body = {"prompt": tokenized["tokens"], "echo": True, "logprobs": 1, "max_tokens": 3}
    again = (await asyncio.to_thread(scored, mesh, {**body, "temperature": 0}))["choices"][0]
    assert again["text"].startswith(PROMPT) and len(again["text"]) > len(PROMPT)
    assert len(again["logprobs"]["tokens"]) == tokenized["count"] + 3
    for first, second in zip(
        logprobs["token_logprobs"][1:], again["logprobs"]["token_logprobs"][1:-3], strict=True
    ):
        assert abs(first - second) < 1e-3


async def test_a_batch_echoes_each_prompt_in_its_choice(mesh: Mesh) -> None:
    prompts = ["Hello there", "Two plus two is four"]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    answer = await asyncio.to_thread(scored, mesh, body)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    for prompt, choice in zip(prompts, choices, strict=True):
        assert choice["text"].startswith(prompt)
        assert "".join(choice["logprobs"]["tokens"]).startswith(prompt)
        assert choice["logprobs"]["token_logprobs"][0] is None


async def test_streamed_echo_sends_the_prompt_first(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model="", prompt=PROMPT, echo=True, max_tokens=4, temperature=0, stream=True
    )
    texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert texts[0].startswith(PROMPT) and len("".join(texts)) > len(PROMPT)


async def test_echo_without_logprobs_and_max_tokens_zero_alone(client, mesh: Mesh) -> None:
    answer = await client.completions.create(
        model="", prompt=PROMPT, echo=True, max_tokens=2, temperature=0
    )
    assert answer.choices[0].text.startswith(PROMPT) and answer.choices[0].logprobs is None
    status, error = await asyncio.to_thread(
        post, mesh, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}
    )
    assert status == 400 and "max_tokens" in json.dumps(error)


async def test_grpc_prompt_logprobs_come_on_the_first_delta(mesh: Mesh) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        tokens = await inference.Tokenize(inference_pb2.TokenizeRequest(text=PROMPT))
        events = [
            event
            async for event in inference.Generate(
                inference_pb2.GenerateRequest(text=PROMPT, sampling=sampling)
            )
        ]
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    first = deltas[0].prompt_logprobs
    assert [e.token_id for e in first] == list(tokens.token_ids)
    assert first[0].logprob == 0 and not first[0].top  # nothing precedes the first token
    assert all(len(e.top) == 3 and e.token_bytes for e in first[1:])
    assert b"".join(e.token_bytes for e in first) == PROMPT.encode()
    assert not any(d.prompt_logprobs for d in deltas[1:])
    assert events[-1].WhichOneof("event") == "completed"


async def test_a_one_token_prompt_has_its_one_entry(mesh: Mesh) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request = inference_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[504]), sampling=sampling
    )
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        events = [event async for event in inference.Generate(request)]
    (first, *_) = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    assert [e.token_id for e in first.prompt_logprobs] == [504]
    assert first.prompt_logprobs[0].token_bytes == b"The"
