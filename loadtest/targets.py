"""The servers a load runs against, each timing one request the same way.

`GrpcTarget` speaks kvmesh's public gRPC API; `OpenAITarget` speaks the OpenAI HTTP API
(`POST /v1/completions`, streamed), so the same load drives kvmesh's HTTP front, llama.cpp's
server or any OpenAI-compatible server. Prompts go as token ids, so every server computes the
same tokens. Times are the client's own (time.perf_counter), from just before the request is
sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import grpc

from loadtest.workload import RequestSpec
from shared import grpc_errors
from shared.outputs import finish_reason_label
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    sent_at: float = 0.0  # seconds since the run started
    outcome: str = "completed"  # completed | cancelled | failed | refused
    reason: str = ""  # finish reason, or the error's reason
    output_tokens: int = 0
    ttft_s: float | None = None  # to the first event carrying a token
    e2e_s: float = 0.0  # to the last event
    itl_s: list[float] = field(default_factory=list)  # gaps between token-carrying events
    queue_s: float | None = None  # the server's own queue time, where it reports one
    reconnects: int = 0  # sends repeated because a pooled connection was already closed

    @property
    def tpot_s(self) -> float | None:
        """Decode time per token after the first: (E2E - TTFT) / (output tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


class Timer:
    """Token-carrying events of one request, timed from its send."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.started = time.perf_counter()
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        now = time.perf_counter() - self.started
        if self._last is None:
            self.record.ttft_s = now
        else:
            self.record.itl_s.append(now - self._last)
        self._last = now
        self.record.output_tokens += count

    def end(self, outcome: str, reason: str) -> RequestRecord:
        self.record.e2e_s = time.perf_counter() - self.started
        self.record.outcome, self.record.reason = outcome, reason
        return self.record


class GrpcTarget:
    def __init__(self, address: str, api_key: str | None = None, model: str = "") -> None:
        self.address = address
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.model = model
        self._channel: grpc.aio.Channel | None = None
        self._stub: inference_pb2_grpc.InferenceStub | None = None

    async def __aenter__(self) -> GrpcTarget:
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def model_info(self) -> common_pb2.ModelInfo:
        assert self._stub is not None
        return await self._stub.GetModel(
            inference_pb2.GetModelRequest(name=self.model), metadata=self.metadata, timeout=10
        )

    async def send(self, spec: RequestSpec) -> RequestRecord:
        assert self._stub is not None
        request = inference_pb2.GenerateRequest(
            model=self.model,
            token_ids=common_pb2.TokenIds(ids=spec.prompt),
            sampling=common_pb2.SamplingParams(max_tokens=spec.max_tokens, **spec.sampling),
            timeout_ms=spec.deadline_ms,
        )
        timer = Timer(RequestRecord(spec.index, len(spec.prompt)))
        call = self._stub.Generate(request, metadata=self.metadata)
        accepted = False
        try:
            async for event in call:
                kind = event.WhichOneof("event")
                accepted = accepted or kind == "accepted"
                if kind == "delta" and event.delta.token_ids:
                    timer.tokens(len(event.delta.token_ids))
                    if (
                        spec.cancel_after_tokens is not None
                        and timer.record.output_tokens >= spec.cancel_after_tokens
                    ):
                        call.cancel()
                        return timer.end("cancelled", "client")
                elif kind == "completed":
                    timer.record.queue_s = event.completed.timings.queue_ms / 1e3
                    reason = finish_reason_label(event.completed.finish_reason)
                    return timer.end("completed", reason)
                elif kind == "cancelled":
                    return timer.end("cancelled", event.cancelled.reason)
                elif kind == "failed":
                    return timer.end("failed", event.failed.error.reason)
        except grpc.aio.AioRpcError as error:
            outcome = "failed" if accepted else "refused"  # refused: before acceptance
            return timer.end(outcome, _grpc_reason(error))
        return timer.end("failed", "stream ended without a terminal event")


def _grpc_reason(error: grpc.aio.AioRpcError) -> str:
    """The kvmesh reason from the rich status (or one inferred from the status code)."""
    return grpc_errors.from_rpc_error(error).reason.value


class OpenAITarget:
    """`POST {base_url}/completions` with `stream: true` and the prompt as token ids."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        model: str = "",
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        """`detokenize`: send prompts as text, for servers that take no token ids (the
        server then counts its own prompt tokens, close to but not always the same)."""
        self.detokenize = detokenize
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAITarget:
        # No client-side cap on connections or time: the server's behaviour is measured.
        # A fresh connection per request: servers close idle keep-alive connections on their
        # own schedule (cpp-httplib, llama-server's HTTP layer, after 5 s idle), and a request
        # sent on one already closed fails before the server sees it. On loopback a connect
        # costs far less than a generation.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        if not self.model:
            async with self._session.get(f"{self.base_url}/models", headers=self.headers) as r:
                r.raise_for_status()
                self.model = (await r.json())["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, spec: RequestSpec) -> RequestRecord:
        assert self._session is not None
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": self.detokenize(spec.prompt) if self.detokenize else spec.prompt,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **spec.sampling,
        }
        if spec.deadline_ms:
            body["timeout_ms"] = spec.deadline_ms  # kvmesh's extension; others ignore it
        if spec.sampling.get("ignore_eos"):
            body["min_tokens"] = spec.max_tokens  # the same effect where ignore_eos is unknown
        timer = Timer(RequestRecord(spec.index, len(spec.prompt)))
        for attempt in range(2):
            try:
                async with self._session.post(
                    f"{self.base_url}/completions", json=body, headers=self.headers
                ) as response:
                    if response.status != 200:
                        return timer.end("refused", await _http_reason(response))
                    return await self._read_stream(response, timer, spec)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as error:
                # A connection closed or reset before a byte of answer (a server dropping
                # connections it cannot take yet): that request never ran, so send it again on
                # a fresh connection, once. After any answer byte it is a real failure.
                if attempt == 0 and timer.record.output_tokens == 0:
                    timer.record.reconnects += 1
                    continue
                return timer.end("failed", type(error).__name__)
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                return timer.end("failed", type(error).__name__)
        raise AssertionError("unreachable: the second attempt returns")

    async def _read_stream(
        self, response: aiohttp.ClientResponse, timer: Timer, spec: RequestSpec
    ) -> RequestRecord:
        finish, usage_tokens = "", None
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue  # blank separators, comments, [DONE]
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                return timer.end("failed", str(error.get("code") or error.get("message")))
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or ():
                # A chunk before the finish (or one with text) carries output: servers stream
                # a chunk per token or per detokenized piece; usage corrects the count at the end.
                if choice.get("text") or choice.get("finish_reason") is None:
                    timer.tokens(1)
                finish = choice.get("finish_reason") or finish
            if (
                spec.cancel_after_tokens is not None
                and timer.record.output_tokens >= spec.cancel_after_tokens
            ):
                response.close()
                return timer.end("cancelled", "client")
        record = timer.end("completed", finish or "stop")
        if usage_tokens is not None:
            record.output_tokens = int(usage_tokens)  # exact, where the server reports usage
        return record


async def _http_reason(response: aiohttp.ClientResponse) -> str:
    try:
        error = (await response.json()).get("error", {})
        return str(error.get("code") or error.get("type") or response.status)
    except (aiohttp.ContentTypeError, json.JSONDecodeError, AttributeError):
        return str(response.status)


def target_for(url: str, api_key: str | None = None, model: str = "") -> GrpcTarget | OpenAITarget:
    """grpc://HOST:PORT (or HOST:PORT) for kvmesh's gRPC API; http(s)://.../v1 for OpenAI."""
    if url.startswith(("http://", "https://")):
        return OpenAITarget(url, api_key, model)
    return GrpcTarget(url.removeprefix("grpc://"), api_key, model)
