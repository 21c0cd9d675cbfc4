"""The tokenizer service: encode text and chats, detokenize streams incrementally."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import Histogram

from services.tokenizer.lanes import TOKENS, Lane, Lanes
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from shared.runtime.metrics import TOKEN_SECONDS
from shared.runtime.service import ServiceRuntime
from shared.runtime.telemetry import context_from_metadata, context_from_traceparent
from shared.text_tokenizer import TextTokenizer
from shared.tool_prompt import function_specs, message_dicts

log = logging.getLogger("kvmesh.tokenizer")
tracer = trace.get_tracer("kvmesh.tokenizer")
ENCODE_SECONDS = Histogram(
    "kvmesh_tokenizer_encode_seconds", "Time to encode one text or chat", buckets=TOKEN_SECONDS
)
# Encodes at once, off the event loop. HF tokenizers hold the GIL while they encode, so these
# interleave between a long prompt's counted pieces (prompt_bound.py) rather than run together.
ENCODE_THREADS = 2


def chat_messages(chat: common_pb2.Chat) -> list[dict[str, Any]]:
    if not chat.messages:
        raise KvmeshError(Reason.INVALID_ARGUMENT, "a chat needs at least one message")
    return message_dicts(chat)


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: TextTokenizer | None  # None: the model ships none (token-id clients only)
    model_path: str


class TokenizerService(tokenizer_pb2_grpc.TokenizerServicer):
    """One tokenizer per model the mesh serves, by model name; under the name "" one tokenizer
    answers for every model (a mesh of one model, or of versions of one)."""

    def __init__(self, runtime: ServiceRuntime, tokenizers: dict[str, LoadedTokenizer]) -> None:
        if not tokenizers:
            raise ValueError("a tokenizer service needs at least one tokenizer")
        self.runtime = runtime
        self.tokenizers = tokenizers
        self._encoding = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="encode")

    def loaded(self, model: str) -> LoadedTokenizer:
        found = self.tokenizers.get(model) or self.tokenizers.get("")
        if found is None and not model:
            found = next(iter(self.tokenizers.values()))  # the default model's
        if found is None:
            raise KvmeshError(
                Reason.MODEL_NOT_FOUND,
                f"no tokenizer for model {model!r}; this service holds "
                f"{', '.join(sorted(self.tokenizers))}",
            )
        return found

    def _require(self, model: str) -> TextTokenizer:
        tokenizer = self.loaded(model).tokenizer
        if tokenizer is None:
            raise KvmeshError(
                Reason.TOKENIZER_UNAVAILABLE,
                "this model ships no tokenizer; send token ids instead of text",
            )
        return tokenizer

    def encode(self, request: tokenizer_pb2.EncodeRequest) -> list[int]:
        tokenizer = self._require(request.model)
        kind = request.WhichOneof("input")
        if kind == "text":
            return tokenizer.encode(request.text, max_tokens=request.max_tokens)
        if kind == "chat":
            tools = function_specs(list(request.chat.tools)) if request.chat.tools else None
            messages = chat_messages(request.chat)
            return tokenizer.encode_chat(messages, tools, max_tokens=request.max_tokens)
        raise KvmeshError(Reason.INVALID_ARGUMENT, "give text or a chat to encode")

    async def Encode(
        self, request: tokenizer_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeResponse:
        parent = context_from_metadata(context.invocation_metadata())
        with tracer.start_as_current_span("tokenizer.Encode", parent, SpanKind.SERVER) as span:
            started = time.perf_counter()
            try:  # off the event loop: a long prompt never holds the detokenizing streams
                token_ids = await asyncio.get_running_loop().run_in_executor(
                    self._encoding, self.encode, request
                )
            except KvmeshError as error:
                span.set_attribute("kvmesh.error.reason", error.reason.value)
                raise
            ENCODE_SECONDS.observe(time.perf_counter() - started)
            TOKENS.labels("encode").inc(len(token_ids))
            span.set_attribute("gen_ai.usage.input_tokens", len(token_ids))
            return tokenizer_pb2.EncodeResponse(token_ids=token_ids)

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        # Whose tokenizer: the first message says (a stream is one request of one model).
        lane: Lane | None = None
        try:
            async for message in request_iterator:
                if lane is None:
                    parent = context_from_metadata(context.invocation_metadata())
                    lane = Lane(
                        self.loaded(message.model).tokenizer, parent, self.runtime.in_flight()
                    )
                yield lane.answer(message)
                if message.finish:
                    return
        finally:
            if lane is not None:
                lane.end()

    async def DetokenizeLanes(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeLanesRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeLanesResponse]:
        lanes = Lanes(self._open_lane)
        try:
            async for message in request_iterator:
                yield lanes.answer(message)
        finally:
            lanes.end_all()

    def _open_lane(self, entry: tokenizer_pb2.DetokenizeLane) -> Lane:
        """A lane counts for a drain as a stream does: the shared stream itself never ends."""
        parent = context_from_traceparent(entry.traceparent)
        return Lane(self.loaded(entry.request.model).tokenizer, parent, self.runtime.in_flight())

    async def GetInfo(
        self, request: tokenizer_pb2.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        loaded = self.loaded(request.model)
        tokenizer = loaded.tokenizer
        return tokenizer_pb2.TokenizerInfo(
            vocab_size=tokenizer.vocab_size if tokenizer else 0,
            has_chat_template=bool(tokenizer and tokenizer.chat_template),
            model_path=loaded.model_path,
        )
