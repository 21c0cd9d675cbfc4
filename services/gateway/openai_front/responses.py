"""The gateway's events -> OpenAI responses: streamed chunks or one response object.

The OpenAI shapes (ids, `object`, choices, logprobs, usage with cached tokens) are built
here from the same events a gRPC client receives; parsing is protocol.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_front.echo import echoed_prompt
from services.gateway.openai_front.protocol import OpenAIRequest
from services.gateway.openai_front.sse import TextChunks, sse
from services.gateway.openai_front.tools import tool_call_object
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
ABORTED = "abort"  # an Abort call ended it (vLLM's finish reason for the same)


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
class Choice:
    """What one of the n completions has sent so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprob_entries: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)
    usage: inference_pb2.Usage | None = None
    finish: str | None = None  # set by its terminal event
    text_offset: int = 0  # characters of completion logprob tokens so far (text_offset)
    started: bool = False  # a chunk went out (a chat stream's first one carries the role)
    num_streamed_calls: int = 0  # tool calls streamed so far (each delta's call index)
    echoed: bool = False  # its prompt went first (echo)
    prompt_entries: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # echo's


@dataclass
class ResponseBuilder:
    """Turns one request's events into OpenAI chunks (streaming) or one response object, with
    a choice per completion (`n`), told apart by each event's index."""

    request: OpenAIRequest
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""
    model: str = ""
    fingerprint: str = ""
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: int = 0
    streamed_tokens: int = 0  # every choice's tokens so far (continuous usage)
    text_chunks: TextChunks = field(default_factory=TextChunks)

    @property
    def object(self) -> str:
        if not self.request.chat:
            return "text_completion"
        return "chat.completion.chunk" if self.request.stream else "chat.completion"

    @property
    def finished(self) -> bool:
        """Every completion has sent its terminal event."""
        return sum(c.finish is not None for c in self.choices.values()) == self.num_choices

    @property
    def num_choices(self) -> int:
        """n per prompt, times the prompts of a completions batch."""
        return max(self.request.generate.n, 1) * max(len(self.request.batch), 1)

    def choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice(index))

    def accepted(self, event: inference_pb2.Accepted) -> None:
        self.id = ("chatcmpl-" if self.request.chat else "cmpl-") + event.request_id
        self.model = event.model
        self.fingerprint = f"kvmesh-{event.model_version}"  # the version that answers
        self.prompt_tokens = event.prompt_tokens

    def delta_sse(self, delta: inference_pb2.Delta, index: int = 0) -> bytes | None:
        """The event for one delta; None when it has nothing to show."""
        encoded = None if delta.tool_calls else self.text_sse(index, delta.text)
        if encoded is None:
            chunk = self.delta_chunk(delta, index)
            return None if chunk is None else sse(chunk)
        self.streamed_tokens += len(delta.token_ids)
        return encoded or None  # text held back

    def text_sse(self, index: int, text: str) -> bytes | None:
        """The event for a delta of text alone (b"" for none: nothing to send), encoded from
        its choice's template; None where the chunk carries more than its text."""
        choice = self.choices.get(index)
        if choice is None or not self._text_only(choice):
            return None
        if not text:
            return b""
        chunk = lambda text: self._chunk(self._choice(choice, text, None))  # noqa: E731
        return self.text_chunks.encode(index, text, chunk)

    @property
    def plain(self) -> bool:
        """Whether the stream's chunks, once started, may differ in their text alone."""
        request = self.request
        return not (request.logprobs or request.continuous_usage or request.echo_only)

    def _text_only(self, choice: Choice) -> bool:  # its chunks now differ in their text alone
        return choice.started and self.plain and (choice.echoed or not self.request.echo)

    def delta_chunk(self, delta: inference_pb2.Delta, index: int = 0) -> dict[str, Any] | None:
        """The chunk for one delta; None when it has nothing to show (text held back)."""
        choice = self.choice(index)
        self.streamed_tokens += len(delta.token_ids)
        text, entries, echoed = self._shown(choice, delta)
        logprobs = self._logprobs(choice, entries, echoed) if self.request.logprobs else None
        if not text and not logprobs and not delta.tool_calls and choice.started:
            return None
        return self._chunk(self._choice(choice, text, logprobs, list(delta.tool_calls)))

    def finish_chunks(self, event: inference_pb2.GenerateEvent) -> list[dict[str, Any]]:
        """The completion's last chunk (with its finish reason) and, after the last
        completion's, the usage of all of them when asked for."""
        choice = self.choice(event.index)
        choice.finish = finish_reason(event)
        chunks = [self._chunk(self._choice(choice, "", None))]
        if self.request.include_usage and self.finished:
            chunks.append(self._chunk(None, usage=usage_object(self.total_usage())))
        return chunks

    def collect(self, event: inference_pb2.GenerateEvent) -> None:
        """A non-streaming answer's delta, usage or terminal event."""
        choice = self.choice(event.index)
        kind = event.WhichOneof("event")
        if kind == "delta":
            text, entries, _ = self._shown(choice, event.delta)
            choice.text.append(text)
            choice.logprob_entries.extend(entries)
            choice.tool_calls.extend(event.delta.tool_calls)
        elif kind == "usage":
            choice.usage = event.usage
        elif kind in ("completed", "cancelled"):
            choice.finish = finish_reason(event)

    def response(self) -> dict[str, Any]:
        """The whole non-streaming answer, its choices in index order."""
        answer = self._chunk(None)
        for index in sorted(self.choices):
            choice = self.choices[index]
            entries, echoed = choice.logprob_entries, bool(choice.prompt_entries)
            logprobs = self._logprobs(choice, entries, echoed) if self.request.logprobs else None
            text = "".join(choice.text)
            answer["choices"].append(self._choice(choice, text, logprobs, choice.tool_calls))
        answer["usage"] = usage_object(self.total_usage())
        return answer

    def total_usage(self) -> inference_pb2.Usage:
        """As OpenAI counts n completions: each prompt once, every completion's tokens."""
        n = max(self.request.generate.n, 1)
        by_prompt: dict[int, list[inference_pb2.Usage]] = {}
        for choice in self.choices.values():
            if choice.usage is not None:
                by_prompt.setdefault(choice.index // n, []).append(choice.usage)
        usages = [u for group in by_prompt.values() for u in group]
        shown = not self.request.echo_only  # its one computed token is not an answer
        return inference_pb2.Usage(
            prompt_tokens=sum(group[0].prompt_tokens for group in by_prompt.values()),
            completion_tokens=sum(u.completion_tokens for u in usages) if shown else 0,
            cached_tokens=sum(max(u.cached_tokens for u in group) for group in by_prompt.values()),
        )

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
            if usage is None and choice is not None and self.request.continuous_usage:
                so_far = inference_pb2.Usage(
                    prompt_tokens=self.prompt_tokens, completion_tokens=self.streamed_tokens
                )
                chunk["usage"] = usage_object(so_far)
        return chunk

    def _choice(
        self,
        state: Choice,
        text: str,
        logprobs: Any,
        calls: list[common_pb2.ToolCall] | None = None,
    ) -> dict[str, Any]:
        finish = state.finish
        choice: dict[str, Any] = {"index": state.index}
        if not self.request.chat:
            choice["text"] = text
        elif self.request.stream:
            delta: dict[str, Any] = {} if state.started else {"role": "assistant"}
            if text or not (finish or calls):
                delta["content"] = text
            if calls:  # each call whole, indexed in the answer's order
                first = state.num_streamed_calls
                state.num_streamed_calls += len(calls)
                delta["tool_calls"] = [
                    {"index": first + i, **tool_call_object(call)} for i, call in enumerate(calls)
                ]
            choice["delta"] = delta
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:  # OpenAI's content is null beside calls when the model wrote none
                message["content"] = text or None
                message["tool_calls"] = [tool_call_object(call) for call in calls]
            choice["message"] = message
        state.started = True
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return choice

    def _shown(
        self, choice: Choice, delta: inference_pb2.Delta
    ) -> tuple[str, list[common_pb2.TokenLogprobs], bool]:
        """A delta's text and logprob entries as the answer shows them: after the prompt's
        on its completion's first delta (echo, then True), none of an echo-only answer's."""
        text, entries = delta.text, list(delta.logprobs)
        if self.request.echo_only:
            text, entries = "", []
        if not self.request.echo or choice.echoed:
            return text, entries, False
        choice.echoed = True
        prompts = self.request.batch or [self.request.generate]
        prompt = prompts[choice.index // max(self.request.generate.n, 1)]
        prompt_text, choice.prompt_entries = echoed_prompt(prompt, delta)
        return prompt_text + text, choice.prompt_entries + entries, True

    def _logprobs(
        self, choice: Choice, entries: list[common_pb2.TokenLogprobs], echoed: bool = False
    ) -> dict[str, Any] | None:
        """`echoed`: entries start with the prompt's, whose first token has no logprob."""
        if self.request.chat:
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(choice.text_offset)
            choice.text_offset += len(_token_text(entry.token_bytes))
        token_logprobs: list[float | None] = [e.logprob for e in entries]
        top_logprobs: list[dict[str, float] | None] = [
            {_token_text(t.token_bytes): t.logprob for t in e.top} for e in entries
        ]
        if echoed and choice.prompt_entries:
            token_logprobs[0] = top_logprobs[0] = None
        return {
            "tokens": [_token_text(e.token_bytes) for e in entries],
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
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
