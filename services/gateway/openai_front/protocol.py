"""OpenAI request bodies -> GenerateRequest (the responses are responses.py).

A thin translation: everything past parsing (admission, auth, tokenization, sampling checks,
stop strings) is the gRPC path's own code. Parsing checks the JSON shapes (a wrong type is a 400
naming the field, never a protobuf TypeError) and where OpenAI's ranges differ from the mesh's:
a completion's `max_tokens` is 0 only with `echo`, `top_p` 0 means `top_k` 1. It also takes the
sampling extensions vLLM users know (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`), `priority`, `timeout_ms` and `disable_speculation`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_front.echo import ask_for_prompt
from services.gateway.openai_front.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_openai_ranges,
    ignore_unknown,
    zero_top_p_as_top_k,
)
from services.gateway.openai_front.prompts import (
    UINT32_MAX,
    is_token_ids,
    one_per_prompt,
    parse_prompts,
)
from services.gateway.openai_front.tools import message_tool_calls, parse_tool_choice, parse_tools
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for the legacy completions API
MAX_TOP_LOGPROBS = 20
_UNSUPPORTED = {  # fields whose non-default values kvmesh does not serve
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "functions": None,  # the deprecated form of `tools`
    "function_call": None,
}


def _invalid(message: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_ARGUMENT, message)


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python; JSON true is not a number.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _invalid(f"'{name}' must be {what}")
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = _typed(body, name, (int, float), "a number")
    return None if value is None else float(value)


UINT64_MAX = 2**64 - 1  # the proto field's range (UINT32_MAX too)


def _count(body: dict[str, Any], name: str, most: int = UINT32_MAX, least: int = 0) -> int | None:
    value = _typed(body, name, (int,), "an integer")
    if value is not None and not least <= value <= most:
        raise _invalid(f"'{name}' must be in [{least}, {most}]")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    return bool(_typed(body, name, (bool,), "true or false"))


@dataclass
class OpenAIRequest:
    """One parsed request: what to generate, and how the answer is to be shaped."""

    chat: bool  # /v1/chat/completions; else /v1/completions
    generate: inference_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    # vLLM's stream_options.continuous_usage_stats (with include_usage): usage so far on
    # every chunk
    continuous_usage: bool = False
    logprobs: bool = False  # render logprobs in the answer
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    echo_only: bool = False  # max_tokens 0 with echo: the prompt scored, nothing generated
    # A completions batch: one request per prompt, the first `generate` (empty: only that)
    batch: list[inference_pb2.GenerateRequest] = field(default_factory=list)
    model: str = ""


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _invalid(f"the body is not JSON: {error}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise _invalid("the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # JSON may escape a lone one, which UTF-8 cannot carry
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as error:
            raise _invalid(f"the body holds invalid Unicode: {error.reason}") from None
    return body


def parse_chat(body: dict[str, Any], max_model_len: Callable[[str], int]) -> OpenAIRequest:
    """`max_model_len(model)` is the default output budget: OpenAI's chat default is "until
    the context is full", and the scheduler stops a request at its context length."""
    ignore_unknown(body, CHAT_FIELDS, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty list")
    chat = common_pb2.Chat(messages=[chat_message(m, i) for i, m in enumerate(messages)])
    chat.tools.extend(parse_tools(body.get("tools")))
    request = _common(body, inference_pb2.GenerateRequest(chat=chat), chat=True)
    parse_tool_choice(body, request.generate.tool_choice)
    sampling = request.generate.sampling
    limit = _count(body, "max_completion_tokens", least=1)
    limit = _count(body, "max_tokens", least=1) if limit is None else limit
    sampling.max_tokens = max_model_len(request.model) if limit is None else limit
    if _flag(body, "logprobs"):
        request.logprobs = True
        top = _count(body, "top_logprobs") or 0
        if top > MAX_TOP_LOGPROBS:
            raise _invalid(f"'top_logprobs' must be at most {MAX_TOP_LOGPROBS}")
        sampling.logprobs = top
    elif body.get("top_logprobs") is not None:
        raise _invalid("'top_logprobs' needs 'logprobs': true")
    return request


def parse_completion(body: dict[str, Any]) -> OpenAIRequest:
    ignore_unknown(body, COMPLETION_FIELDS, "completions")
    prompts = parse_prompts(body.get("prompt"))
    request = _common(body, prompts[0], chat=False)
    sampling = request.generate.sampling
    limit, echo = _count(body, "max_tokens"), _flag(body, "echo")
    if limit == 0 and not echo:
        raise _invalid("'max_tokens' must be at least 1 (0 only with 'echo': true)")
    if limit is not None:
        sampling.max_tokens = limit  # unset: 16, OpenAI's completions default and ours
    top = _count(body, "logprobs")
    if top is not None:
        if top > MAX_COMPLETION_LOGPROBS:
            raise _invalid(f"'logprobs' must be at most {MAX_COMPLETION_LOGPROBS}")
        request.logprobs = True
        sampling.logprobs = top
    if echo:
        request.echo, request.echo_only = True, limit == 0
        ask_for_prompt(sampling, prompts[0], request.logprobs, request.echo_only)
    request.batch = one_per_prompt(request.generate, prompts)
    return request


def chat_message(message: Any, index: int) -> common_pb2.ChatMessage:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _invalid(f"messages[{index}] must be an object with a 'role'")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _invalid(f"messages[{index}]: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise _invalid(f"messages[{index}].content must be a string or a list of text parts")
    parsed = common_pb2.ChatMessage(role=message["role"], content=content)
    parsed.tool_calls.extend(message_tool_calls(message.get("tool_calls"), index))
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise _invalid(f"messages[{index}].{name} must be a string")
        setattr(parsed, name, value or "")
    return parsed


def _common(
    body: dict[str, Any], generate: inference_pb2.GenerateRequest, *, chat: bool
) -> OpenAIRequest:
    for name, default in _UNSUPPORTED.items():
        if name == "echo" and not chat:
            continue  # completions echo the prompt (parse_completion)
        value = body.get(name)
        if value not in (None, default) and value != [] and value != {}:
            raise _invalid(f"'{name}' = {value!r} is not supported (only {default!r})")
    model = _typed(body, "model", (str,), "a string") or ""
    generate.model = model
    sampling = generate.sampling
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"):
        value = _number(body, name)
        if value is not None:
            setattr(sampling, name, value)
    check_openai_ranges(body)
    repetition_penalty = _number(body, "repetition_penalty")
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    for name, maximum in (("top_k", UINT32_MAX), ("seed", UINT64_MAX)):
        count = _count(body, name, maximum)
        if count is not None:
            setattr(sampling, name, count)
    zero_top_p_as_top_k(sampling)
    sampling.ignore_eos = _flag(body, "ignore_eos")
    sampling.disable_speculation = _flag(body, "disable_speculation")
    stop_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids") or []
    if not is_token_ids(stop_ids):
        raise _invalid("'stop_token_ids' must be a list of token ids")
    sampling.stop_token_ids.extend(stop_ids)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _invalid("'stop' must be a string or a list of strings")
    generate.stop.extend(stops)
    _response_format(body.get("response_format"), sampling.response_format)
    _logit_bias(body.get("logit_bias"), sampling.logit_bias)
    priority = _typed(body, "priority", (int,), "an integer") or 0
    if not -(2**31) <= priority < 2**31:
        raise _invalid("'priority' must be a 32-bit integer")
    generate.priority = priority
    generate.timeout_ms = _count(body, "timeout_ms") or 0
    generate.user = _typed(body, "user", (str,), "a string") or ""
    n = _count(body, "n")
    if n == 0:
        raise _invalid("'n' must be at least 1")
    generate.n = n or 1
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    stream = _flag(body, "stream")
    if options and not stream:
        raise _invalid("'stream_options' needs 'stream': true")
    return OpenAIRequest(
        chat=chat,
        generate=generate,
        stream=stream,
        include_usage=_flag(options, "include_usage"),
        continuous_usage=_flag(options, "include_usage")
        and _flag(options, "continuous_usage_stats"),
        model=model,
    )


def _logit_bias(value: Any, into: Any) -> None:
    """OpenAI's map of token ids (as JSON object keys, so strings) to biases."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _invalid("'logit_bias' must be an object of token id -> bias")
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= UINT32_MAX):
            raise _invalid(f"'logit_bias' keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise _invalid(f"'logit_bias' values must be numbers, got {bias!r}")
        into[int(key)] = float(bias)


def _response_format(value: Any, into: common_pb2.ResponseFormat) -> None:
    """OpenAI's `text`, `json_object` and `json_schema`, plus kvmesh's `regex` and `lark`."""
    if value is None:
        return
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise KvmeshError(Reason.INVALID_SCHEMA, "'response_format' must be an object with 'type'")
    kind = value["type"]
    if kind == "text":
        return
    if kind == "json_object":
        into.kind = kind
    elif kind == "json_schema":
        wrapper = value.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if not isinstance(schema, dict):
            raise KvmeshError(
                Reason.INVALID_SCHEMA, "'response_format.json_schema.schema' must be an object"
            )
        into.kind, into.spec = kind, json.dumps(schema)
    elif kind in ("regex", "lark"):
        spec = value.get(kind if kind == "regex" else "grammar")
        if not isinstance(spec, str):
            key = "regex" if kind == "regex" else "grammar"
            raise KvmeshError(Reason.INVALID_SCHEMA, f"'response_format.{key}' must be a string")
        into.kind, into.spec = kind, spec
    else:
        raise KvmeshError(
            Reason.INVALID_SCHEMA,
            f"unknown response_format type {kind!r}: text, json_object, json_schema, regex, lark",
        )
