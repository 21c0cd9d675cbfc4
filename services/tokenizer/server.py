"""The tokenizer service: encode text and chats, detokenize streams incrementally."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.loader import TextTokenizer
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from shared.service import ServiceRuntime

log = logging.getLogger("kvmesh.tokenizer")


def chat_messages(chat: common_pb2.Chat) -> list[dict[str, str]]:
    if not chat.messages:
        raise KvmeshError(Reason.INVALID_ARGUMENT, "a chat needs at least one message")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


class TokenizerService(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(
        self, runtime: ServiceRuntime, tokenizer: TextTokenizer | None, model_path: str
    ) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.model_path = model_path

    def _require(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise KvmeshError(
                Reason.TOKENIZER_UNAVAILABLE,
                "this model ships no tokenizer; send token ids instead of text",
            )
        return self.tokenizer

    def encode(self, request: tokenizer_pb2.EncodeRequest) -> list[int]:
        tokenizer = self._require()
        kind = request.WhichOneof("input")
        if kind == "text":
            return tokenizer.encode(request.text)
        if kind == "chat":
            return tokenizer.encode_chat(chat_messages(request.chat))
        raise KvmeshError(Reason.INVALID_ARGUMENT, "give text or a chat to encode")

    async def Encode(
        self, request: tokenizer_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeResponse:
        try:
            return tokenizer_pb2.EncodeResponse(token_ids=self.encode(request))
        except KvmeshError as error:
            await grpc_errors.abort(context, error)
            raise

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        # A model without a tokenizer still serves token-id clients: their text is empty.
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        with self.runtime.in_flight():
            async for message in request_iterator:
                text = detokenizer.push(message.token_ids) if detokenizer else ""
                if message.finish and detokenizer:
                    text += detokenizer.flush()
                yield tokenizer_pb2.DetokenizeResponse(text=text)
                if message.finish:
                    return

    async def GetInfo(
        self, request: tokenizer_pb2.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        tokenizer = self.tokenizer
        return tokenizer_pb2.TokenizerInfo(
            vocab_size=tokenizer.vocab_size if tokenizer else 0,
            has_chat_template=bool(tokenizer and tokenizer.chat_template),
            model_path=self.model_path,
        )
