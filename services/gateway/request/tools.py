"""A request's tools: checked at admission, and `required` or a named function turned into
the grammar that constrains the output to calls (llguidance, like any response format).

The grammar is the Hermes syntax the tool prompt teaches (shared/tool_prompt.py): each call a
JSON object `{"name": ..., "arguments": ...}` in a <tool_call> block, written with json.dumps'
separators, its arguments valid against that function's schema. Calls are bounded in number so
a sampled output always ends: after the last one only the end token is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import inference_pb2
from shared.sampling import ResponseFormat, SamplingParams
from shared.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

Mode = inference_pb2.ToolChoice.Mode
MAX_TOOLS = 128
MAX_CALLS = 8  # per answer with `required`: the grammar's bound, so every output can end
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# json.dumps' separators, as the tool prompt writes calls; no other whitespace.
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _invalid(message: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class ToolUse:
    """What the answer may do with the request's tools."""

    schemas: dict[str, dict[str, Any]]  # function name -> its arguments' JSON schema
    mode: int  # a ToolChoice.Mode
    function: str = ""  # with MODE_FUNCTION
    single_call: bool = False

    @property
    def constrained(self) -> bool:
        return self.mode in (Mode.MODE_REQUIRED, Mode.MODE_FUNCTION)

    @property
    def parsed(self) -> bool:
        """Whether calls are parsed out of the output (all modes but `none`)."""
        return self.mode != Mode.MODE_NONE

    def grammar(self) -> ResponseFormat:
        """The Lark grammar of the calls this tool use allows."""
        names = [self.function] if self.mode == Mode.MODE_FUNCTION else list(self.schemas)
        body = {
            "anyOf": [_call_schema(name, self.schemas[name]) for name in names],
            "x-guidance": CALL_JSON_STYLE,
        }
        one = self.single_call or self.mode == Mode.MODE_FUNCTION
        start = "start: call" if one else f'start: call ("\\n" call){{0,{MAX_CALLS - 1}}}'
        open_tag, close_tag = json.dumps(TOOL_CALL_OPEN + "\n"), json.dumps("\n" + TOOL_CALL_CLOSE)
        lines = [
            start,
            f"call: {open_tag} body {close_tag}",
            f"body: %json {json.dumps(body)}",
        ]
        return ResponseFormat("lark", "\n".join(lines))


def _call_schema(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_use(request: inference_pb2.GenerateRequest) -> ToolUse | None:
    """The request's tools and tool choice, checked; None when it has no tools (a tool choice
    other than `auto` or `none` then is INVALID_ARGUMENT)."""
    choice = request.tool_choice
    tools = request.chat.tools if request.WhichOneof("input") == "chat" else []
    if not tools:
        if choice.mode in (Mode.MODE_REQUIRED, Mode.MODE_FUNCTION):
            raise _invalid("tool_choice 'required' or a named function needs tools in the chat")
        return None
    if len(tools) > MAX_TOOLS:
        raise _invalid(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if not FUNCTION_NAME.fullmatch(tool.name):
            raise _invalid(f"tool name {tool.name!r}: 1 to 64 letters, digits, '_' or '-'")
        if tool.name in schemas:
            raise _invalid(f"tool {tool.name!r} is given twice")
        schemas[tool.name] = _parameters(tool.name, tool.parameters_json)
    if choice.mode == Mode.MODE_FUNCTION and choice.function not in schemas:
        raise _invalid(f"tool_choice names {choice.function!r}, which is not among the tools")
    return ToolUse(schemas, choice.mode, choice.function, choice.single_call)


def _parameters(name: str, text: str) -> dict[str, Any]:
    if not text:
        return NO_ARGUMENTS
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise KvmeshError(
            Reason.INVALID_SCHEMA, f"tool {name!r}: parameters are not JSON: {error}"
        ) from None
    if not isinstance(schema, dict):
        raise KvmeshError(Reason.INVALID_SCHEMA, f"tool {name!r}: parameters must be an object")
    return schema


def constrain_to_calls(use: ToolUse | None, sampling: SamplingParams) -> SamplingParams:
    """The sampling with the calls' grammar as its response format, for `required` and a
    named function; a response format of the request's own cannot hold beside it."""
    if use is None or not use.constrained:
        return sampling
    if sampling.response_format is not None:
        raise _invalid(
            "response_format cannot be combined with tool_choice 'required' or a function"
        )
    return dataclasses.replace(sampling, response_format=use.grammar())
