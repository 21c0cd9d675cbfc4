"""The gateway's events -> OpenAI responses: streamed chunks or one response object.

The OpenAI shapes (ids, `object`, choices, logprobs, usage with cached tokens) are built
here from the same events a gRPC client receives; parsing is openai_protocol.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_protocol import OpenAIRequest
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
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
