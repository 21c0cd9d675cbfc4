"""Tools in a chat prompt, and the syntax the model answers in.

A chat template that renders `tools` (Qwen2.5, Hermes, Llama 3.1...) gets them as
transformers hands them over: OpenAI-shaped function specs, and earlier calls as each
assistant message's `tool_calls` with arguments as objects. A template that renders none, such
as the default model's, gets kvmesh's own system message instead: the functions as JSON lines
in <tools>, and the Hermes call syntax, one JSON object per <tool_call> block, which is what the
gateway parses and what `required` constrains the output to. Earlier calls are then written
into the assistant's text in that same syntax, so the model sees its own past calls as it
would have written them.
"""

from __future__ import annotations

import json
from typing import Any

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_INTRO = (
    "You can call functions to answer the user. Their signatures are JSON objects, one per "
    "line, inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and its arguments inside "
    "<tool_call></tool_call>, one block per call:\n"
    '<tool_call>\n{{"name": "the function\'s name", "arguments": {{"argument": "value"}}}}\n'
    "</tool_call>"
)


def renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (transformers' convention)."""
    return "tools" in template


def function_specs(tools: list[common_pb2.Tool]) -> list[dict[str, Any]]:
    """The tools as OpenAI function specs, the shape chat templates expect."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": json.loads(tool.parameters_json or '{"type": "object"}'),
            },
        }
        for tool in tools
    ]


def call_block(name: str, arguments: dict[str, Any]) -> str:
    """One call in the Hermes syntax, JSON as json.dumps writes it (what `required` allows)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def message_dicts(chat: common_pb2.Chat) -> list[dict[str, Any]]:
    """The chat's messages as a chat template reads them (tool calls in OpenAI's shape)."""
    messages = []
    for message in chat.messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments(call)},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    return messages


def _arguments(call: common_pb2.ToolCall) -> dict[str, Any]:
    """An earlier call's arguments as the object templates expect; INVALID_ARGUMENT if the
    text is not a JSON object."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise KvmeshError(
            Reason.INVALID_ARGUMENT, f"tool call {call.id!r}: arguments must be a JSON object"
        )
    return arguments


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages for a template that renders no tools: the tool list joins the system
    message (one is added first when there is none), and earlier calls become the assistant's
    text."""
    rewritten = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            message["content"] = "\n".join(filter(None, [message["content"], *blocks]))
        rewritten.append(message)
    if not tools:
        return rewritten
    lines = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in tools)
    intro = TOOLS_INTRO.format(tools=lines)
    if rewritten and rewritten[0]["role"] == "system":
        rewritten[0]["content"] = f"{rewritten[0]['content']}\n\n{intro}"
    else:
        rewritten.insert(0, {"role": "system", "content": intro})
    return rewritten
