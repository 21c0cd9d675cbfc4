"""OpenAI request bodies -> GenerateRequest, and the gateway's events -> OpenAI responses.

A thin translation: everything past parsing (admission, auth, tokenization, sampling checks,
stop strings) is the gRPC path's own code. Parsing checks only the JSON shapes, so a wrong
type is a 400 naming the field, never a protobuf TypeError. Beyond OpenAI's fields, the
sampling extensions vLLM users know (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`) plus `priority` and `timeout_ms` are accepted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

FINISH_REASONS = {
    inference_pb2.FINISH_REASON_STOP: "stop",
    inference_pb2.FINISH_REASON_STOP_STRING: "stop",
    inference_pb2.FINISH_REASON_LENGTH: "length",
}
ABORTED = "abort"  # an Abort call ended it (vLLM's finish reason for the same)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for the legacy completions API
MAX_TOP_LOGPROBS = 20
_UNSUPPORTED = {  # fields whose non-default values kvmesh does not serve
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "tools": None,
    "functions": None,
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


UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1  # the proto fields' ranges


def _count(body: dict[str, Any], name: str, maximum: int = UINT32_MAX) -> int | None:
    value = _typed(body, name, (int,), "an integer")
    if value is not None and not 0 <= value <= maximum:
        raise _invalid(f"'{name}' must be in [0, {maximum}]")
    return value


def _token_ids(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in values
    )


def _flag(body: dict[str, Any], name: str) -> bool:
    return bool(_typed(body, name, (bool,), "true or false"))


@dataclass
class OpenAIRequest:
    """One parsed request: what to generate, and how the answer is to be shaped."""

    chat: bool  # /v1/chat/completions; else /v1/completions
    generate: inference_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    logprobs: bool = False  # render logprobs in the answer
    model: str = ""


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _invalid(f"the body is not JSON: {error}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise _invalid("the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object")
    return body


def parse_chat(body: dict[str, Any], max_model_len: Callable[[str], int]) -> OpenAIRequest:
    """`max_model_len(model)` is the default output budget: OpenAI's chat default is "until
    the context is full", and the scheduler stops a request at its context length."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty list")
    chat = common_pb2.Chat(messages=[_chat_message(m, i) for i, m in enumerate(messages)])
    request = _common(body, inference_pb2.GenerateRequest(chat=chat), chat=True)
    sampling = request.generate.sampling
    limit = _count(body, "max_completion_tokens")
    limit = _count(body, "max_tokens") if limit is None else limit
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
    request = _common(body, _prompt(body.get("prompt")), chat=False)
    sampling = request.generate.sampling
    limit = _count(body, "max_tokens")
    if limit is not None:
        sampling.max_tokens = limit  # unset: 16, OpenAI's completions default and ours
    top = _count(body, "logprobs")
    if top is not None:
        if top > MAX_COMPLETION_LOGPROBS:
            raise _invalid(f"'logprobs' must be at most {MAX_COMPLETION_LOGPROBS}")
        request.logprobs = True
        sampling.logprobs = top
    return request


def _chat_message(message: Any, index: int) -> common_pb2.ChatMessage:
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
    return common_pb2.ChatMessage(role=message["role"], content=content)


def _prompt(prompt: Any) -> inference_pb2.GenerateRequest:
    """A string or token ids; a list of one prompt is that prompt (n = 1, one prompt a call)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return inference_pb2.GenerateRequest(text=prompt)
    if prompt and _token_ids(prompt):
        return inference_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt))
    raise _invalid("'prompt' must be a string or a list of token ids (one prompt per call)")


def _common(
    body: dict[str, Any], generate: inference_pb2.GenerateRequest, *, chat: bool
) -> OpenAIRequest:
    for name, default in _UNSUPPORTED.items():
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
    repetition_penalty = _number(body, "repetition_penalty")
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    for name, maximum in (("top_k", UINT32_MAX), ("seed", UINT64_MAX)):
        count = _count(body, name, maximum)
        if count is not None:
            setattr(sampling, name, count)
    sampling.ignore_eos = _flag(body, "ignore_eos")
    stop_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids") or []
    if not _token_ids(stop_ids):
        raise _invalid("'stop_token_ids' must be a list of token ids")
    sampling.stop_token_ids.extend(stop_ids)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _invalid("'stop' must be a string or a list of strings")
    generate.stop.extend(stops)
    _response_format(body.get("response_format"), sampling.response_format)
    priority = _typed(body, "priority", (int,), "an integer") or 0
    if not -(2**31) <= priority < 2**31:
        raise _invalid("'priority' must be a 32-bit integer")
    generate.priority = priority
    generate.timeout_ms = _count(body, "timeout_ms") or 0
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    stream = _flag(body, "stream")
    if options and not stream:
        raise _invalid("'stream_options' needs 'stream': true")
    return OpenAIRequest(
        chat=chat,
        generate=generate,
        stream=stream,
        include_usage=_flag(options, "include_usage"),
        model=model,
    )


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


def usage_object(usage: inference_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


@dataclass
class ResponseBuilder:
    """Turns one request's events into OpenAI chunks (streaming) or one response object."""

    request: OpenAIRequest
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""
    model: str = ""
    fingerprint: str = ""
    text: list[str] = field(default_factory=list)
    logprob_entries: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    usage: inference_pb2.Usage | None = None
    _text_offset: int = 0  # characters of completion logprob tokens so far (text_offset)
    _started: bool = False  # a chunk went out (a chat stream's first one carries the role)

    @property
    def object(self) -> str:
        chat = self.request.chat
        if self.request.stream:
            return "chat.completion.chunk" if chat else "text_completion"
        return "chat.completion" if chat else "text_completion"

    def accepted(self, event: inference_pb2.Accepted) -> None:
        self.id = ("chatcmpl-" if self.request.chat else "cmpl-") + event.request_id
        self.model = event.model
        self.fingerprint = f"kvmesh-{event.model_version}"  # the version that answers

    def delta_chunk(self, delta: inference_pb2.Delta) -> dict[str, Any] | None:
        """The chunk for one delta; None when it has nothing to show (text held back)."""
        logprobs = self._logprobs(list(delta.logprobs)) if self.request.logprobs else None
        if not delta.text and not logprobs and self._started:
            return None
        return self._chunk(self._choice(delta.text, logprobs, None))

    def finish_chunks(self, event: inference_pb2.GenerateEvent) -> list[dict[str, Any]]:
        """The last choice chunk (with its finish reason) and, when asked for, the usage."""
        chunks = [self._chunk(self._choice("", None, finish_reason(event)))]
        if self.request.include_usage and self.usage is not None:
            chunks.append(self._chunk(None, usage=usage_object(self.usage)))
        return chunks

    def collect(self, delta: inference_pb2.Delta) -> None:
        self.text.append(delta.text)
        self.logprob_entries.extend(delta.logprobs)

    def response(self, event: inference_pb2.GenerateEvent) -> dict[str, Any]:
        """The whole non-streaming answer."""
        logprobs = self._logprobs(self.logprob_entries) if self.request.logprobs else None
        answer = self._chunk(self._choice("".join(self.text), logprobs, finish_reason(event)))
        answer["usage"] = usage_object(self.usage or inference_pb2.Usage())
        return answer

    def _chunk(
        self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [] if choice is None else [choice],
        }
        if self.request.stream and self.request.include_usage:
            chunk["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
        return chunk

    def _choice(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if not self.request.chat:
            choice["text"] = text
        elif self.request.stream:
            delta: dict[str, str] = {} if self._started else {"role": "assistant"}
            if text or not finish:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["message"] = {"role": "assistant", "content": text}
        self._started = True
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return choice

    def _logprobs(self, entries: list[common_pb2.TokenLogprobs]) -> dict[str, Any] | None:
        if self.request.chat:
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(_token_text(entry.token_bytes))
        return {
            "tokens": [_token_text(e.token_bytes) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                {_token_text(t.token_bytes): t.logprob for t in e.top} for e in entries
            ],
            "text_offset": offsets,
        }


def _chat_logprob(entry: common_pb2.TokenLogprobs) -> dict[str, Any]:
    return {
        "token": _token_text(entry.token_bytes),
        "logprob": entry.logprob,
        "bytes": list(entry.token_bytes),
        "top_logprobs": [
            {
                "token": _token_text(t.token_bytes),
                "logprob": t.logprob,
                "bytes": list(t.token_bytes),
            }
            for t in entry.top
        ],
    }


def finish_reason(event: inference_pb2.GenerateEvent) -> str:
    if event.WhichOneof("event") == "completed":
        return FINISH_REASONS.get(event.completed.finish_reason, "stop")
    return ABORTED
