"""Tool calling through the OpenAI front and the gRPC API, on the real mesh and the default
model (whose chat template renders no tools: kvmesh's tool prompt stands in)."""

from __future__ import annotations

import json
from collections import defaultdict

import grpc
import jsonschema
import openai
import pytest

from kvmesh.mesh.launcher import Mesh
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.mesh_helpers import assert_one_terminal, chat_request, collect, model_name

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": f"The {name[4:]} somewhere", "parameters": s},
    }
    for name, s in SCHEMAS.items()
]


MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


def assert_valid_calls(calls: list, allowed: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_gives_valid_calls_of_the_tools_in_every_sample(client) -> None:
    model = await model_name(client)
    choices = []
    for seed in (1, 2):  # 2 x 10 completions, sampled at temperature 1.0
        answer = await client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            n=10,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        choices.extend(answer.choices)
    assert len(choices) == 20
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls, set(SCHEMAS))
        assert len({call.id for call in choice.message.tool_calls}) == len(
            choice.message.tool_calls
        )


async def test_a_named_function_is_the_one_call(client) -> None:
    answer = await client.chat.completions.create(
        model=await model_name(client),
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        n=8,
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls, {"get_time"})


async def test_streamed_calls_accumulate_to_the_whole_answer(client) -> None:
    request = {
        "model": await model_name(client),
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 11,
        "n": 3,
        "max_tokens": 400,
    }
    whole = await client.chat.completions.create(**request)
    stream = await client.chat.completions.create(**request, stream=True)
    # As SDKs accumulate: per choice, per call index, id/name once and arguments concatenated.
    calls: dict[int, dict[int, dict]] = defaultdict(dict)
    finishes = {}
    async for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    for choice in whole.choices:
        expected = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls
        ]
        streamed = [calls[choice.index][i] for i in sorted(calls[choice.index])]
        assert streamed == expected
        assert finishes[choice.index] == "tool_calls"


async def test_calls_cut_by_max_tokens_leave_no_markup_in_the_content(client) -> None:
    """Cut anywhere in a call: the whole calls before it, no partial one, finish `length`."""
    model = await model_name(client)
    for max_tokens in (6, 20, 33):
        for stream in (False, True):
            request = {
                "model": model,
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": "required",
                "temperature": 1.0,
                "seed": 5,
                "n": 4,
                "max_tokens": max_tokens,
            }
            if not stream:
                answer = await client.chat.completions.create(**request)
                for choice in answer.choices:
                    assert choice.finish_reason == "length"
                    assert not choice.message.content, choice.message.content
                    for call in choice.message.tool_calls or []:
                        assert_valid_calls([call], set(SCHEMAS))
                continue
            content, finishes = "", set()
            async for chunk in await client.chat.completions.create(**request, stream=True):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    finishes |= {choice.finish_reason} - {None}
            assert content == "" and finishes == {"length"}


async def test_a_conversation_with_earlier_calls_and_results_continues(client) -> None:
    model = await model_name(client)
    first = await client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200
    )
    message = first.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": '{"answer": 42}'}
        for call in message.tool_calls
    ]
    follow_up = [*MESSAGES, message.model_dump(exclude_none=True), *results]
    answer = await client.chat.completions.create(
        model=model, messages=follow_up, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    # The earlier calls and their results are in the prompt.
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


async def test_grpc_completed_event_carries_the_calls_streamed_in_deltas(mesh: Mesh) -> None:
    request = chat_request(MESSAGES[0]["content"], max_tokens=200, temperature=0.0)
    request.chat.tools.extend(
        common_pb2.Tool(name=name, parameters_json=json.dumps(s)) for name, s in SCHEMAS.items()
    )
    request.tool_choice.mode = inference_pb2.ToolChoice.MODE_FUNCTION
    request.tool_choice.function = "get_weather"
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        events = await collect(inference_pb2_grpc.InferenceStub(channel), request)
    assert assert_one_terminal(events) == "completed"
    completed = events[-1].completed
    assert completed.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    streamed = [call for e in events if e.HasField("delta") for call in e.delta.tool_calls]
    assert list(completed.tool_calls) == streamed and len(streamed) == 1
    assert streamed[0].name == "get_weather"
    jsonschema.validate(json.loads(streamed[0].arguments), WEATHER)
    assert "".join(e.delta.text for e in events if e.HasField("delta")) == ""


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"tool_choice": "required"}, "INVALID_ARGUMENT"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "INVALID_ARGUMENT",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "INVALID_ARGUMENT",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "INVALID_ARGUMENT"),  # a name twice
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "INVALID_ARGUMENT",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "INVALID_ARGUMENT"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "INVALID_SCHEMA",
        ),
    ],
)
async def test_bad_tool_requests_are_400(client, extra: dict, code: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model=await model_name(client), messages=MESSAGES, max_tokens=4, **extra
        )
    assert raised.value.code == code
