"""The gateway's side of the tokenizer service: one channel, its stub, and whether it serves.

Every request needs the tokenizer (text in, text out): without it the gateway refuses at once
rather than accept a stream that cannot show a token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from services.gateway.mesh.connections import watch_health
from services.gateway.mesh.detokenize_lanes import DetokenizeLanes
from services.gateway.mesh.tokenizer_errors import tokenizer_failure
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from shared.runtime.service import CHANNEL_OPTIONS
from shared.runtime.tls import aio_channel


def check_vocabulary(ids: list[int], model: common_pb2.ModelInfo) -> None:
    bad = [t for t in ids if t >= model.vocab_size]
    if bad:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})",
        )


class TokenizerLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = aio_channel(address, options=CHANNEL_OPTIONS)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        self.lanes = DetokenizeLanes(self.stub)  # every request's detokenizing, one stream
        self.ready = False

    async def watch(self, on_change: Callable[[], Awaitable[None]]) -> None:
        async def on_status(serving: bool) -> None:
            if serving != self.ready:
                self.ready = serving
                await on_change()

        await watch_health(self.channel, on_status, f"tokenizer {self.address}")

    def require(self) -> None:
        if not self.ready:
            raise KvmeshError(
                Reason.TOKENIZER_LOST,
                "the tokenizer service is not serving",
                retryable=True,
                retry_after_ms=1000,
            )

    async def prompt_token_ids(
        self,
        request: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest,
        model: common_pb2.ModelInfo,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...] = (),
        max_tokens: int = 0,
    ) -> list[int]:
        """The request's prompt as token ids: its own (checked against the vocabulary), or its
        text or chat encoded by the tokenizer service, which refuses one that certainly has
        more than `max_tokens` before encoding it whole."""
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)  # type: ignore[union-attr]
            check_vocabulary(ids, model)
        elif kind in ("text", "chat"):
            if kind == "text":
                encode = tokenizer_pb2.EncodeRequest(text=request.text, model=model.name)
            else:
                encode = tokenizer_pb2.EncodeRequest(chat=request.chat, model=model.name)
            encode.max_tokens = max_tokens
            try:
                reply = await self.stub.Encode(encode, timeout=timeout, metadata=metadata)
            except grpc.RpcError as error:
                raise tokenizer_failure(error) from None
            ids = list(reply.token_ids)
        else:
            raise KvmeshError(Reason.INVALID_ARGUMENT, "give text, chat or token_ids as the input")
        if not ids:
            raise KvmeshError(Reason.EMPTY_PROMPT, "the prompt has no tokens")
        return ids

    async def text_of(
        self, ids: list[int], model: common_pb2.ModelInfo, timeout: float | None
    ) -> str:
        """Token ids as text, whole: one detokenizing stream of one message."""
        check_vocabulary(ids, model)
        request = tokenizer_pb2.DetokenizeRequest(token_ids=ids, finish=True, model=model.name)
        try:
            replies = self.stub.Detokenize(iter([request]), timeout=timeout)
            return "".join([reply.text async for reply in replies])
        except grpc.RpcError as error:
            raise tokenizer_failure(error) from None

    async def close(self) -> None:
        await self.lanes.aclose()
        await self.channel.close()
