"""OpenAI's tool fields -> the request's: `tools`, `tool_choice`, `parallel_tool_calls`, and
the calls of earlier assistant messages. Shapes only; names, schemas and the choice's
consistency with the tools are checked by admission (services/gateway/request/tools.py), as for a
gRPC client."""

from __future__ import annotations

import json
from typing import Any

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

Mode = inference_pb2.ToolChoice.Mode
CHOICES = {"auto": Mode.MODE_AUTO, "none": Mode.MODE_NONE, "required": Mode.MODE_REQUIRED}


def _invalid(message: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_ARGUMENT, message)


def parse_tools(tools: Any) -> list[common_pb2.Tool]:
    """`[{"type": "function", "function": {"name", "description", "parameters"}}]`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _invalid("'tools' must be a list")
    parsed = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _invalid(f"tools[{index}] must be an object of type 'function'")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _invalid(f"tools[{index}].function must be an object with a 'name'")
        description = function.get("description") or ""
        parameters = function.get("parameters")
        if not isinstance(description, str):
            raise _invalid(f"tools[{index}].function.description must be a string")
        if parameters is not None and not isinstance(parameters, dict):
            raise KvmeshError(
                Reason.INVALID_SCHEMA, f"tools[{index}].function.parameters must be an object"
            )
        parsed.append(
            common_pb2.Tool(
                name=function["name"],
                description=description,
                parameters_json=json.dumps(parameters) if parameters is not None else "",
            )
        )
    return parsed


def parse_tool_choice(body: dict[str, Any], into: inference_pb2.ToolChoice) -> None:
    """`"auto"`, `"none"`, `"required"` or `{"type": "function", "function": {"name"}}`, and
    `parallel_tool_calls` (true unless false)."""
    choice = body.get("tool_choice")
    if isinstance(choice, str) and choice in CHOICES:
        into.mode = CHOICES[choice]
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _invalid("'tool_choice' must name a function: {'type': 'function', ...}")
        into.mode, into.function = Mode.MODE_FUNCTION, name
    elif choice is not None:
        raise _invalid("'tool_choice' must be 'none', 'auto', 'required' or a function")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("'parallel_tool_calls' must be true or false")
    into.single_call = parallel is False


def message_tool_calls(calls: Any, index: int) -> list[common_pb2.ToolCall]:
    """An assistant message's `tool_calls`, their arguments JSON text as OpenAI sends them."""
    if calls is None:
        return []
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise _invalid(f"{where} must be a list")
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _invalid(f"{where}: each call needs a function with a 'name'")
        arguments = function.get("arguments") or "{}"
        if not isinstance(arguments, str) or not _is_json_object(arguments):
            raise _invalid(f"{where}: arguments must be a JSON object as a string")
        parsed.append(
            common_pb2.ToolCall(
                id=str(call.get("id") or ""), name=function["name"], arguments=arguments
            )
        )
    return parsed


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def tool_call_object(call: common_pb2.ToolCall) -> dict[str, Any]:
    """A call as OpenAI returns it in `message.tool_calls`."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
