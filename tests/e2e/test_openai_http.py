"""The gateway's OpenAI-compatible HTTP front on the real mesh and the default model, driven
by the official `openai` client, and by a plain HTTP client for the SSE bytes."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import urllib.parse

import grpc
import jsonschema
import openai
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import inference_pb2_grpc
from tests.e2e.mesh_helpers import (
    assert_mesh_idle,
    chat_request,
    collect,
    model_name,
    output_text,
    settled_load,
)
from tests.engine_worker.test_structured_output import SCHEMAS

QUESTION = "What is the capital of France?"
SSE_EVENT = re.compile(rb"data: ([^\n]+)\n\n")


async def test_chat_answer_equals_the_grpc_answer(mesh: Mesh, client) -> None:
    model = await model_name(client)
    answer = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        events = await collect(
            inference_pb2_grpc.InferenceStub(channel),
            chat_request(QUESTION, max_tokens=24, temperature=0.0),
        )
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == output_text(events)
    assert choice.finish_reason in ("stop", "length")
    usage = events[-1].completed.usage
    assert answer.usage.prompt_tokens == usage.prompt_tokens
    assert answer.usage.completion_tokens == usage.completion_tokens
    assert answer.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert answer.model == model and answer.object == "chat.completion"
    assert answer.id.startswith("chatcmpl-")


async def test_chat_stream_with_usage_adds_up_to_the_whole_answer(client) -> None:
    model = await model_name(client)
    request = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_completion_tokens": 24,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)
    stream = await client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[:-1] == [None] * (len(finishes) - 1)
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


async def test_continuous_usage_stats_count_on_every_chunk(client) -> None:
    """vLLM's stream_options.continuous_usage_stats: usage so far on each chunk, n summed."""
    stream = await client.completions.create(
        model=await model_name(client),
        prompt=QUESTION,
        max_tokens=12,
        n=2,
        temperature=1.0,
        seed=4,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore
    )
    chunks = [chunk async for chunk in stream]
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 24
    counts = [c.usage.completion_tokens for c in choice_chunks]
    assert all(c.choices and c.usage is not None for c in choice_chunks)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 24
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks
    )


async def test_completions_stream_and_whole_agree_with_logprobs(client) -> None:
    model = await model_name(client)
    request = {
        "model": model,
        "prompt": "The three primary colors are",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 2,
    }
    whole = await client.completions.create(**request)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == whole.usage.completion_tokens == 12
    assert "".join(logprobs.tokens) == choice.text  # plain ASCII output: pieces concatenate
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 2 and logprob <= 0
        assert top[token] == pytest.approx(logprob)  # greedy: the sampled token is the best
        assert logprob == pytest.approx(max(top.values()))
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    stream = await client.completions.create(**request, stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == (
        logprobs.tokens
    )


async def test_chat_logprobs_carry_token_bytes_and_alternatives(client) -> None:
    answer = await client.chat.completions.create(
        model=await model_name(client),
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == answer.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


async def test_json_schema_answers_validate(client) -> None:
    model = await model_name(client)
    schemas = SCHEMAS[:3]

    async def ask(schema: dict, seed: int) -> openai.types.chat.ChatCompletion:
        return await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Answer with one JSON value."}],
            max_tokens=160,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
        )

    answers = await asyncio.gather(*(ask(s, seed) for s in schemas for seed in (1, 2)))
    finished = 0
    for index, answer in enumerate(answers):
        if answer.choices[0].finish_reason != "stop":
            continue
        finished += 1
        jsonschema.validate(json.loads(answer.choices[0].message.content), schemas[index // 2])
    assert finished >= 4
    json_object = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if json_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(json_object.choices[0].message.content), dict)


async def test_response_format_holds_for_every_one_of_n_choices(client) -> None:
    schema = SCHEMAS[2]  # an enum and a boolean: short, so every choice finishes
    answer = await client.chat.completions.create(
        model=await model_name(client),
        messages=[{"role": "user", "content": "Answer with one JSON value."}],
        max_tokens=60,
        temperature=1.0,
        seed=5,
        n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def raw_post(url: str, path: str, body: dict) -> tuple[http.client.HTTPResponse, bytes]:
    """A plain HTTP/1.1 client: the response body exactly as sent (after de-chunking)."""
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    connection.request(
        "POST", parsed.path + path, json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    return response, response.read()


async def test_sse_framing_byte_for_byte(mesh: Mesh) -> None:
    model = (await asyncio.to_thread(_models, mesh.http_url))[0]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "ignore_eos": True,  # kvmesh's extension, as vLLM's: exactly 8 tokens
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response, raw = await asyncio.to_thread(raw_post, mesh.http_url, "/chat/completions", body)
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    assert response.getheader("Cache-Control") == "no-cache"
    # Nothing but `data: <one line of JSON>\n\n` events, then exactly `data: [DONE]\n\n`.
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = SSE_EVENT.findall(raw)
    assert b"".join(b"data: " + e + b"\n\n" for e in events) == raw
    assert events[-1] == b"[DONE]" and b"[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    request_id = response.getheader("X-Request-Id")
    assert {c["id"] for c in chunks} == {f"chatcmpl-{request_id}"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert b"\r" not in raw


def _models(url: str) -> list[str]:
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    connection.request("GET", parsed.path + "/models")
    return [m["id"] for m in json.loads(connection.getresponse().read())["data"]]


async def test_a_client_that_hangs_up_cancels_the_request_upstream(mesh: Mesh, client) -> None:
    stream = await client.chat.completions.create(
        model=await model_name(client),
        messages=[{"role": "user", "content": "Tell an endless story."}],
        max_tokens=2000,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    async for _chunk in stream:
        break  # it runs: now hang up
    await stream.close()
    load = await settled_load(mesh.scheduler_addresses[0], timeout=10)
    assert load.num_free_blocks == load.num_blocks
    # A whole (non-streaming) answer the client stops waiting for: the same.
    with pytest.raises(openai.APITimeoutError):
        await client.completions.create(
            model=await model_name(client),
            prompt="An endless story:",
            max_tokens=2000,
            extra_body={"ignore_eos": True},
            timeout=2.0,
        )
    load = await settled_load(mesh.scheduler_addresses[0], timeout=10)
    assert load.num_free_blocks == load.num_blocks


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"messages": []}, "INVALID_ARGUMENT"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "INVALID_ARGUMENT"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            "INVALID_ARGUMENT",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "INVALID_ARGUMENT"),
        # OpenAI's documented ranges, each end.
        *(
            ({"messages": [{"role": "user", "content": "hi"}], name: value}, code)
            for name, value, code in [
                ("temperature", 2.5, "INVALID_SAMPLING_PARAMS"),
                ("temperature", -0.1, "INVALID_SAMPLING_PARAMS"),
                ("top_p", 1.01, "INVALID_SAMPLING_PARAMS"),
                ("top_p", -0.01, "INVALID_SAMPLING_PARAMS"),
                ("presence_penalty", 2.5, "INVALID_SAMPLING_PARAMS"),
                ("presence_penalty", -2.5, "INVALID_SAMPLING_PARAMS"),
                ("frequency_penalty", 2.5, "INVALID_SAMPLING_PARAMS"),
                ("frequency_penalty", -2.5, "INVALID_SAMPLING_PARAMS"),
                ("n", 0, "INVALID_ARGUMENT"),
            ]
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "INVALID_ARGUMENT",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}},
            },
            "INVALID_SCHEMA",
        ),
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "PROMPT_TOO_LONG"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}},
            "INVALID_SAMPLING_PARAMS",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"4000000": 1}},
            "INVALID_SAMPLING_PARAMS",
        ),  # outside the vocabulary
    ],
)
async def test_bad_requests_are_400_with_a_stable_code(client, body: dict, code: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(**{"model": await model_name(client), **body})
    assert raised.value.status_code == 400
    assert raised.value.code == code
    assert raised.value.body["retryable"] is False


async def test_the_range_ends_and_unknown_fields_are_accepted(client) -> None:
    for extra in (
        {"temperature": 2.0, "top_p": 1.0, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"temperature": 0.0, "presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"temperature": 1.0, "top_p": 0},  # OpenAI's range includes 0: the top token alone
    ):
        answer = await client.chat.completions.create(
            model=await model_name(client),
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=2,
            seed=1,
            extra_body={"a_field_no_route_reads": {"x": 1}},
            **extra,
        )
        assert answer.usage.completion_tokens == 2


async def test_logit_bias_steers_sampling_and_user_is_accepted(client) -> None:
    answer = await client.chat.completions.create(
        model=await model_name(client),
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=1.0,
        logit_bias={"1234": 100},
        logprobs=True,
        user="end-user-7",
    )
    assert [t.token for t in answer.choices[0].logprobs.content] == [
        answer.choices[0].logprobs.content[0].token
    ] * 4
    assert answer.usage.completion_tokens == 4


async def test_unknown_models_and_paths_are_404(mesh: Mesh, client) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.code == "MODEL_NOT_FOUND"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")
    assert (await client.models.retrieve(await model_name(client))).owned_by == "kvmesh"
    response, raw = await asyncio.to_thread(raw_post, mesh.http_url, "/images/generations", {})
    assert response.status == 404 and json.loads(raw)["error"]["code"] == "INVALID_ARGUMENT"
    response, raw = await asyncio.to_thread(raw_post, mesh.http_url, "/embeddings", {})
    assert response.status == 400 and "'input' must be" in json.loads(raw)["error"]["message"]
    body = {"model": "no-such-model", "input": "hi"}
    response, raw = await asyncio.to_thread(raw_post, mesh.http_url, "/embeddings", body)
    assert response.status == 404 and json.loads(raw)["error"]["code"] == "MODEL_NOT_FOUND"


BATCH = ["The capital of France is", "One, two, three,", "My favourite colour is"]


async def test_a_batch_of_prompts_answers_each_as_alone_in_order(mesh: Mesh, client) -> None:
    model = await model_name(client)
    request = {"model": model, "max_tokens": 6, "temperature": 0, "n": 2}
    alone = [await client.completions.create(prompt=p, **request) for p in BATCH]
    batch = await client.completions.create(prompt=BATCH, **request)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, answer in enumerate(alone):
        for j in range(2):  # prompt i's completion j is choice i * n + j, as vLLM numbers them
            assert batch.choices[2 * i + j].text == answer.choices[j].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts: dict[int, str] = {}
    finishes = {}
    stream = await client.completions.create(prompt=BATCH, stream=True, **request)
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in batch.choices}
    assert set(finishes) == set(range(6))
    ids = await client.completions.create(
        model=model, prompt=[[504, 3575], [282, 4649, 314]], max_tokens=2
    )
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


async def test_a_batch_with_one_refused_prompt_fails_whole_and_frees_everything(
    mesh: Mesh, client
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(
            model=await model_name(client), prompt=["hi", "hi " * 9000, "there"], max_tokens=64
        )
    assert raised.value.code == "PROMPT_TOO_LONG"
    await assert_mesh_idle(mesh)  # the accepted prompts cancelled upstream, their blocks free
