"""The gateway's OpenAI-compatible HTTP front, on its own port beside gRPC.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events)
    POST /v1/embeddings   POST /tokenize   POST /detokenize (vLLM's)
    GET  /v1/models   GET /v1/models/{model}   GET /health   GET /metrics

Each request goes through the same GenerateHandler as a gRPC Generate call: the same admission,
Bearer-key auth (checked first, on every path but /health: guards.py), rate limits, routing,
tracing (a `traceparent` header joins the client's trace) and errors. Errors are OpenAI error
objects whose `code` is the kvmesh reason, plus `retryable`; retryable ones carry `Retry-After`
(seconds) and `retry-after-ms`, which the official client honours. A client that closes the
connection cancels the request upstream: the handler task is cancelled (aiohttp's
handler_cancellation) or its next write fails, and closing the event iterator cancels the
scheduler's stream, which frees the KV blocks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.openai_front.batch import batch_events
from services.gateway.openai_front.embeddings import parse_embeddings
from services.gateway.openai_front.guards import PARSER_HEADER_BYTES, body_of, guards
from services.gateway.openai_front.http_errors import (
    bad_http_in_one_line,
    error_object,
    error_response,
    openai_errors,
)
from services.gateway.openai_front.protocol import (
    OpenAIRequest,
    parse_body,
    parse_chat,
    parse_completion,
)
from services.gateway.openai_front.responses import ResponseBuilder
from services.gateway.openai_front.sse import DONE, sse
from services.gateway.openai_front.tokenize import detokenize, tokenize
from services.gateway.policy.stall import (
    ClientStalled,
    write_at_once,
    write_or_stall,
    writes_at_once,
)
from services.gateway.request.call_context import HttpCall
from services.gateway.request.embed import embed
from services.gateway.request.generate import GenerateHandler
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import inference_pb2
from shared.runtime.tls import http_ssl_context, tls_config

log = logging.getLogger("kvmesh.gateway.http")
Event = inference_pb2.GenerateEvent

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# After an error answered before its body was read, aiohttp reads on this long (10 s by
# default) before it closes: a client holding a partial body is let go sooner.
LINGER_S = 1.0


class OpenAIFront:
    def __init__(self, generate: GenerateHandler, catalog: ModelCatalog) -> None:
        self.generate = generate
        self.catalog = catalog
        self.started = int(time.time())
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    def app(self) -> web.Application:
        policy = self.generate.policy
        max_bytes = policy.limits.max_request_bytes
        checked = guards(policy.api_keys, policy.body_timeout_s, policy.max_http_per_client)
        app = web.Application(middlewares=[openai_errors, checked], client_max_size=max_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        """`reuse_port`: the port is shared with the host's other gateways (SO_REUSEPORT)."""
        logging.getLogger("aiohttp.server").addFilter(bad_http_in_one_line)
        # handler_cancellation: a client that hangs up cancels its handler, and the request.
        # Headers (and the wait between two requests on a kept-alive connection) are bounded
        # by aiohttp's keep-alive timer: the same bound as a body's.
        self._runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            lingering_time=LINGER_S,
            keepalive_timeout=self.generate.policy.body_timeout_s,
            max_line_size=PARSER_HEADER_BYTES,
            max_field_size=PARSER_HEADER_BYTES,
        )
        await self._runner.setup()
        tls = tls_config()
        context = http_ssl_context(tls) if tls is not None else None
        self._site = web.TCPSite(
            self._runner, host, port, ssl_context=context, reuse_port=reuse_port
        )
        await self._site.start()
        scheme = "https" if tls is not None else "http"
        log.info("openai http", extra={"address": f"{scheme}://{host}:{port}/v1"})

    async def stop_listening(self) -> None:
        """No new connection from now on; the open ones go on (a shared port's new ones go to
        the host's other gateways)."""
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _call(self, request: web.Request) -> HttpCall:
        return HttpCall(list(request.headers.items()))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(parse_body(body_of(request)), self._max_model_len)
        return await self._serve(request, parsed)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion(parse_body(body_of(request))))

    async def embeddings(self, request: web.Request) -> web.Response:
        runtime = self.generate.runtime
        with runtime.in_flight():
            runtime.refuse_if_draining()
            parsed = parse_embeddings(parse_body(body_of(request)))
            reply = await embed(self.catalog, parsed.embed, timeout=None)
        return web.json_response(parsed.response(reply))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = parse_body(body_of(request))
        metadata = self._call(request).invocation_metadata()
        tenant = self.generate.policy.api_keys.authenticate(metadata)  # charged its tokens
        return web.json_response(await tokenize(self.catalog, self.generate, body, tenant))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = parse_body(body_of(request))
        return web.json_response(await detokenize(self.catalog, self.generate, body))

    def _max_model_len(self, model: str) -> int:
        return self.catalog.pick(model).served_model().max_model_len

    async def _serve(self, request: web.Request, parsed: OpenAIRequest) -> web.StreamResponse:
        parsed.generate.request_id = request.headers.get("X-Request-Id", "")
        call = self._call(request)
        if len(parsed.batch) > 1:
            events = batch_events(self.generate, parsed.batch, call)
        else:
            events = self.generate(parsed.generate, call)
        async with contextlib.aclosing(events):  # closing cancels the request upstream
            first = await events.__anext__()  # a refusal raises here, before any byte is sent
            builder = ResponseBuilder(parsed)
            builder.accepted(first.accepted)
            headers = {"X-Request-Id": first.accepted.request_id}
            if parsed.stream:
                # A batch's events are renumbered on their way: each goes through its task.
                sinks = call if builder.plain and len(parsed.batch) <= 1 else None
                return await self._stream(request, events, builder, headers, sinks)
            response = await self._whole(events, builder)
            response.headers.update(headers)
            return response

    async def _stream(
        self,
        request: web.Request,
        events: AsyncGenerator[Event, None],
        builder: ResponseBuilder,
        headers: dict[str, str],
        sinks: HttpCall | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await response.prepare(request)
        if sinks is not None:
            sinks.text_sink = functools.partial(_text_at_once, request, response, builder)
        try:
            await self._write_events(request, response, events, builder)
        except ConnectionResetError:  # the client left between two chunks: nothing to send
            log.info("client closed the stream")
        except ClientStalled as stalled:
            with contextlib.suppress(ClientStalled):
                await events.athrow(stalled)  # (events is the request's own generator)
            if request.transport is not None:  # no way to say more to a client not reading
                request.transport.close()
        return response

    async def _write_events(
        self,
        request: web.Request,
        response: web.StreamResponse,
        events: AsyncIterator[Event],
        builder: ResponseBuilder,
    ) -> None:
        stall_s = self.generate.policy.stall_timeout_s

        async def send(payload: bytes) -> None:
            if writes_at_once(request.transport, len(payload)):
                await response.write(payload)  # cannot block: no timer to arm
            else:
                await write_or_stall(response.write(payload), stall_s)

        async for event in events:
            kind = event.WhichOneof("event")
            if kind == "delta":
                encoded = builder.delta_sse(event.delta, event.index)
                if encoded is not None:
                    await send(encoded)
            elif kind == "usage":
                builder.choice(event.index).usage = event.usage
            elif kind == "failed":
                await send(sse(error_object(grpc_errors.from_pb(event.failed.error))))
            elif kind in ("completed", "cancelled"):
                for chunk in builder.finish_chunks(event):
                    await send(sse(chunk))
        await send(DONE)
        await response.write_eof()

    async def _whole(self, events: AsyncIterator[Event], builder: ResponseBuilder) -> web.Response:
        async for event in events:
            if event.WhichOneof("event") == "failed":  # one failed completion fails the answer
                return error_response(grpc_errors.from_pb(event.failed.error))
            builder.collect(event)
            if builder.finished:
                return web.json_response(builder.response())
        raise KvmeshError(Reason.INTERNAL, "the request ended without a terminal event")

    async def list_models(self, request: web.Request) -> web.Response:
        # Each model by name (its traffic split chooses the version), then each version.
        served = self.catalog.models()
        by_name: dict[str, dict[str, Any]] = {}
        for model in served:
            by_name.setdefault(model.name, self._model(model, model.name))
        versions = [self._model(m, f"{m.name}@{m.version}") for m in served]
        return web.json_response({"object": "list", "data": [*by_name.values(), *versions]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        return web.json_response(self._model(self.catalog.pick(name).served_model(), name))

    def _model(self, info: Any, model_id: str) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "kvmesh",
            "root": info.artifact_digest,
            "max_model_len": info.max_model_len,
            "backend": info.backend,  # "sim": tokens drawn, no model computed
        }

    async def health(self, request: web.Request) -> web.Response:
        """200 while this gateway takes requests (a scheduler ready, not draining), else 503."""
        serving = not self.generate.runtime.draining and self.catalog.registry.ready
        return web.json_response(
            {"status": "serving" if serving else "not_serving"}, status=200 if serving else 503
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _text_at_once(
    request: web.Request,
    response: web.StreamResponse,
    builder: ResponseBuilder,
    index: int,
    text: str,
    num_tokens: int,
) -> bool:
    """A parked relay's delta (parked_relays.py): its chunk written now, from the step pass,
    when it is plain text and the socket takes it without waiting; else False."""
    payload = builder.text_sse(index, text)
    if payload is None:
        return False
    if payload:  # else held back: nothing to send
        at_once = writes_at_once(request.transport, len(payload))
        if not at_once or not write_at_once(response.write(payload)):
            return False
    builder.streamed_tokens += num_tokens
    return True
