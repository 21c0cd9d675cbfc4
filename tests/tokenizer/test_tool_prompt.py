"""Tools in the chat prompt: a template that renders them gets OpenAI-shaped specs and calls;
one that renders none (the default model's) gets kvmesh's tool prompt in the system message,
and earlier calls in the assistant's text in the syntax the gateway parses."""

from __future__ import annotations

import copy
import json

import pytest

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2
from shared.text_tokenizer import TextTokenizer
from shared.tool_prompt import call_block, function_specs, message_dicts

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = common_pb2.Chat(
    messages=[
        common_pb2.ChatMessage(role="user", content="Weather in Oslo?"),
        common_pb2.ChatMessage(
            role="assistant",
            tool_calls=[
                common_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
            ],
        ),
        common_pb2.ChatMessage(role="tool", content="-3 C", tool_call_id="call_1"),
    ],
    tools=[
        common_pb2.Tool(
            name="get_weather", description="Weather now", parameters_json=json.dumps(CITY)
        )
    ],
)


def test_a_template_without_tools_gets_the_tool_prompt(tokenizer: TextTokenizer) -> None:
    text = tokenizer.apply_chat_template(message_dicts(CHAT), function_specs(list(CHAT.tools)))
    system, user, assistant, tool, prompt = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nYou can call functions")
    spec = {"type": "function", "function": {"name": "get_weather", "description": "Weather now"}}
    spec["function"]["parameters"] = CITY
    assert f"<tools>\n{json.dumps(spec)}\n</tools>" in system
    assert user == "<|im_start|>user\nWeather in Oslo?"
    assert assistant == "<|im_start|>assistant\n" + call_block("get_weather", {"city": "Oslo"})
    assert tool == "<|im_start|>tool\n-3 C"
    assert prompt == "<|im_start|>assistant\n"


def test_an_existing_system_message_keeps_its_text_first(tokenizer: TextTokenizer) -> None:
    chat = common_pb2.Chat()
    chat.CopyFrom(CHAT)
    chat.messages.insert(0, common_pb2.ChatMessage(role="system", content="Be brief."))
    text = tokenizer.apply_chat_template(message_dicts(chat), function_specs(list(chat.tools)))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert text.count("<|im_start|>system") == 1


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them(
    tokenizer: TextTokenizer,
) -> None:
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}\n"
        "{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
        "{{ c.function.arguments | tojson }}{% endfor %};{% endfor %}"
    )
    own = copy.copy(tokenizer)
    own.chat_template = template
    text = own.apply_chat_template(message_dicts(CHAT), function_specs(list(CHAT.tools)))
    assert text == (
        f"TOOL get_weather {json.dumps(CITY)}\n"
        "user: Weather in Oslo?;"
        'assistant: CALL get_weather{"city": "Oslo"};'
        "tool: -3 C;"
    )


def test_an_earlier_call_whose_arguments_are_not_an_object_is_invalid() -> None:
    chat = common_pb2.Chat()
    chat.CopyFrom(CHAT)
    chat.messages[1].tool_calls[0].arguments = "[1, 2]"
    with pytest.raises(KvmeshError) as refused:
        message_dicts(chat)
    assert refused.value.reason == Reason.INVALID_ARGUMENT and "call_1" in refused.value.message
