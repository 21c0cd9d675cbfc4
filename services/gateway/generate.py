"""One Generate stream: admit, submit to a scheduler, relay its tokens as text deltas.

Admission, in order: authenticate the tenant, bound this gateway's in-flight requests, check
and tokenize the input, charge the tenant's rate limits, route (which refuses when every
scheduler is past the watermarks), submit.

Exactly one terminal event ends every accepted stream. The scheduler's per-step token events
go through one Detokenize stream per request (never half a UTF-8 character), then through the
stop-string matcher, which may end the request early: cancelling the Submit call aborts it
upstream and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.gateway.admission import (
    check_stop_strings,
    prompt_token_ids,
    resolve_sampling,
    time_remaining,
)
from services.gateway.backends import Backends, Routed, SchedulerBackend
from services.gateway.call_context import CallContext
from services.gateway.limits import RequestLimits
from services.gateway.output_check import check_output
from services.gateway.rate_limits import Grant, RateLimiter
from services.gateway.request_record import (
    FINISH_REASONS,
    ActiveRequest,
    Admitted,
    Progress,
    completed_event,
    terminal_reason,
    upstream_failure,
    upstream_request_id,
)
from services.gateway.request_telemetry import RequestTelemetry
from services.gateway.router import Router
from services.gateway.stall import ClientStalled
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tenants import ApiKeys, Tenant
from services.gateway.text_stream import TextStream
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.logs import bind_request
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, scheduler_pb2
from shared.service import ServiceRuntime

log = logging.getLogger("kvmesh.gateway")
Event = inference_pb2.GenerateEvent
TERMINAL = ("completed", "cancelled", "failed")


@dataclass
class GatewayPolicy:
    """Who may send what, and where it goes."""

    api_keys: ApiKeys = field(default_factory=ApiKeys)
    router: Router = field(default_factory=lambda: Router(None))
    rate_limiter: RateLimiter = field(default_factory=lambda: RateLimiter(None))
    max_in_flight: int = 4096  # this gateway's own bound on open streams
    limits: RequestLimits = field(default_factory=RequestLimits)
    stall_timeout_s: float = 30.0  # a client that takes no event this long is cancelled
    trace_content: bool = False  # prompt and completion text in spans (off: never)


class GenerateHandler:
    def __init__(
        self, runtime: ServiceRuntime, backends: Backends, policy: GatewayPolicy | None = None
    ) -> None:
        self.runtime = runtime
        self.backends = backends
        self.policy = policy or GatewayPolicy()
        # Open requests by (tenant, request id): a tenant sees and aborts only its own.
        self.active: dict[tuple[str, str], ActiveRequest] = {}
        self._num_admitting = 0
        self._releases: set[asyncio.Task[None]] = set()

    async def __call__(
        self, request: inference_pb2.GenerateRequest, context: CallContext
    ) -> AsyncGenerator[Event, None]:
        """The request's events. A refusal raises KvmeshError before the first event; once
        `accepted` is out, every failure is a `failed` event and exactly one terminal event
        ends the stream. Closing the iterator early cancels the request upstream."""
        received = time.monotonic()
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        bind_request(request_id)
        telemetry = RequestTelemetry(
            request_id,
            context.invocation_metadata(),
            "chat" if request.WhichOneof("input") == "chat" else "text_completion",
            self.policy.trace_content,
        )
        try:
            admitted = await self._admit(request, request_id, context, received, telemetry)
        except KvmeshError as error:
            log.info("refused", extra={"reason": error.reason.value, "error": error.message})
            telemetry.rejected(error)
            raise  # before the first event: the front turns it into a status
        except BaseException:
            telemetry.ended("cancelled", "client_disconnected", 0, 0)
            raise
        backend, submit = admitted.backend, admitted.submit
        active_key = (admitted.tenant.name, request_id)
        self.active[active_key] = ActiveRequest(backend, admitted.upstream_id)
        prompt_tokens = len(admitted.token_ids)
        route = admitted.routed.route
        log.info(
            "accepted",
            extra={
                "tenant": admitted.tenant.name,
                "prompt_tokens": prompt_tokens,
                "queue_position": admitted.queue_position,
                "scheduler": backend.address,
                "matched_blocks": route.matched_blocks,
                "route_reason": route.reason,
                "trace_id": telemetry.trace_id,
            },
        )
        progress = Progress(prompt_tokens, received)
        text = TextStream(
            self.backends.tokenizer, telemetry.detokenize_metadata(), admitted.model.name
        )
        outcome, reason = "cancelled", "client_disconnected"  # unless a terminal event is sent
        with self.runtime.in_flight():
            try:
                yield Event(
                    accepted=inference_pb2.Accepted(
                        request_id=request_id,
                        queue_position=admitted.queue_position,
                        prompt_tokens=prompt_tokens,
                        model=admitted.model.name,
                        model_version=admitted.model.version,
                        routing=route.to_pb(),
                        trace_id=telemetry.trace_id,
                    )
                )
                async for event in self._relay(request, admitted, text, progress):
                    kind = event.WhichOneof("event")
                    if kind == "delta":
                        telemetry.delta(event.delta.text, len(event.delta.token_ids))
                    elif kind in TERMINAL:
                        outcome, reason = kind, terminal_reason(event)
                        log.info(
                            kind,
                            extra={
                                "completion_tokens": progress.completion_tokens,
                                "ttft_ms": round(
                                    ((progress.first_token_at or received) - received) * 1e3, 2
                                ),
                            },
                        )
                    sending = time.monotonic()
                    yield event
                    telemetry.blocked_sending(time.monotonic() - sending)
            except ClientStalled:  # thrown in by the front whose write stayed blocked
                outcome, reason = "cancelled", "client_stalled"
                log.info("client stalled: cancelled")
                raise
            finally:
                submit.cancel()  # a no-op when it ended; else the scheduler aborts the request
                text.cancel()
                self.active.pop(active_key, None)
                admitted.routed.ended()
                self._release(admitted.grant, prompt_tokens + progress.completion_tokens)
                telemetry.detokenize_ended(text.wait_s)
                telemetry.ended(outcome, reason, prompt_tokens, progress.completion_tokens)

    async def _admit(
        self,
        request: inference_pb2.GenerateRequest,
        request_id: str,
        context: CallContext,
        received: float,
        telemetry: RequestTelemetry,
    ) -> Admitted:
        with telemetry.phase("admission"):
            self.runtime.refuse_if_draining()
            tenant = self.policy.api_keys.authenticate(context.invocation_metadata())
            self.policy.limits.check_size(request.ByteSize())
            if (tenant.name, request_id) in self.active:
                raise KvmeshError(Reason.INVALID_ARGUMENT, f"request id {request_id!r} is in use")
            if len(self.active) + self._num_admitting >= self.policy.max_in_flight:
                raise KvmeshError(
                    Reason.OVERLOADED,
                    f"this gateway already holds {self.policy.max_in_flight} requests",
                    retryable=True,
                    retry_after_ms=1000,
                )
            check_stop_strings(list(request.stop))
            candidates = self.backends.serving(request.model)
            model = candidates[0].model
            assert model is not None
            sampling = resolve_sampling(request.sampling, model.default_sampling)
            self.backends.require_tokenizer()
        self._num_admitting += 1
        try:
            return await self._check_and_submit(
                request, request_id, context, received, tenant, sampling, candidates, telemetry
            )
        finally:
            self._num_admitting -= 1

    async def _check_and_submit(
        self,
        request: inference_pb2.GenerateRequest,
        request_id: str,
        context: CallContext,
        received: float,
        tenant: Tenant,
        sampling: common_pb2.SamplingParams,
        candidates: list[SchedulerBackend],
        telemetry: RequestTelemetry,
    ) -> Admitted:
        model = candidates[0].model
        assert model is not None
        remaining = time_remaining(context, request.timeout_ms)
        telemetry.prompt(request.text)
        with telemetry.phase("tokenize") as span:
            token_ids = await prompt_token_ids(
                request, self.backends.tokenizer, model, remaining, telemetry.phase_metadata(span)
            )
            span.set_attribute("gen_ai.usage.input_tokens", len(token_ids))
        self.policy.limits.check_tokens(len(token_ids), sampling.max_tokens)
        limiter = self.policy.rate_limiter
        with telemetry.phase("rate_limit"):
            grant = await limiter.admit(tenant, request_id, len(token_ids) + sampling.max_tokens)
        try:
            with telemetry.phase("route") as span:
                route = await self.policy.router.route(candidates, token_ids, tenant.cache_salt)
                span.set_attributes(route.span_attributes())
            routed = Routed(route)
            routed_model = route.backend.model or model
            upstream_id = upstream_request_id(request_id, tenant, bool(request.request_id))
            try:
                if remaining is not None:
                    remaining -= time.monotonic() - received
                submit, position = await self._submit(
                    route.backend,
                    request,
                    upstream_id,
                    token_ids,
                    sampling,
                    tenant,
                    remaining,
                    telemetry.metadata(),
                )
            except BaseException:
                routed.ended()
                raise
            routed.accepted()
        except BaseException:
            self._release(grant, 0)
            raise
        telemetry.admitted(
            {
                "gen_ai.request.model": model.name,
                "gen_ai.response.model": model.name,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.request.seed": sampling.seed,
                "gen_ai.usage.input_tokens": len(token_ids),
                "kvmesh.tenant": tenant.name,
                **route.span_attributes(),
            }
        )
        return Admitted(
            routed, tenant, grant, sampling, token_ids, submit, position, upstream_id, routed_model
        )

    async def _submit(
        self,
        backend: SchedulerBackend,
        request: inference_pb2.GenerateRequest,
        request_id: str,
        token_ids: list[int],
        sampling: common_pb2.SamplingParams,
        tenant: Tenant,
        remaining: float | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> tuple[grpc.aio.UnaryStreamCall, int]:
        submit = backend.stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id=request_id,
                token_ids=token_ids,
                sampling=sampling,
                priority=request.priority,
                cache_salt=tenant.cache_salt,
                tenant=tenant.name,
            ),
            timeout=remaining,
            metadata=metadata,
        )
        try:
            first = await submit.read()
        except grpc.RpcError as error:
            raise grpc_errors.from_rpc_error(error) from None
        except asyncio.CancelledError:
            submit.cancel()  # the client left before acceptance: do not leave it queued
            raise
        if first is grpc.aio.EOF or first.WhichOneof("event") != "accepted":
            raise KvmeshError(Reason.INTERNAL, "the scheduler did not accept the request")
        return submit, first.accepted.queue_position

    def _release(self, grant: Grant | None, tokens_used: int) -> None:
        """Return the tenant's charge in the background: a stream's cleanup never waits on
        Redis, and a cancelled stream still releases."""
        if grant is None:
            return
        task = asyncio.create_task(self.policy.rate_limiter.release(grant, tokens_used))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _relay(
        self,
        request: inference_pb2.GenerateRequest,
        admitted: Admitted,
        text: TextStream,
        progress: Progress,
    ) -> AsyncIterator[Event]:
        submit = admitted.submit
        stops = StopStringMatcher(list(request.stop))
        response_format = admitted.sampling.response_format
        output: list[str] | None = [] if response_format.kind else None  # checked at the end
        try:
            while True:
                event = await submit.read()
                kind = "eof" if event is grpc.aio.EOF else event.WhichOneof("event")
                if kind == "tokens":
                    ids = list(event.tokens.token_ids)
                    progress.completion_tokens += len(ids)
                    admitted.routed.started()
                    logprobs = event.tokens.logprobs
                    released = stops.push(await text.push(ids, logprobs=logprobs))
                    if output is not None:
                        output.append(released)
                    first = progress.first_token_at is None
                    progress.first_token_at = progress.first_token_at or time.monotonic()
                    yield Event(
                        delta=inference_pb2.Delta(
                            text=released,
                            token_ids=ids,
                            logprobs=logprobs,
                            first_token=first,
                        )
                    )
                    if stops.matched is not None:
                        submit.cancel()  # aborts upstream: blocks free within a step
                        yield Event(usage=progress.usage())
                        yield completed_event(
                            inference_pb2.FINISH_REASON_STOP_STRING,
                            stops.matched,
                            None,
                            progress,
                            admitted,
                        )
                        return
                elif kind == "finished":
                    finished = event.finished
                    progress.cached_tokens = finished.cached_tokens
                    released = stops.push(await text.push([], finish=True))
                    if stops.matched is None:
                        released += stops.flush()
                    if released:
                        yield Event(delta=inference_pb2.Delta(text=released))
                    if (
                        output is not None
                        and stops.matched is None
                        and (finished.finish_reason == scheduler_pb2.SCHEDULER_FINISH_REASON_STOP)
                    ):  # ended by the grammar, not cut short by a length or a stop string
                        check_output(response_format, "".join(output) + released)
                    yield Event(usage=progress.usage())
                    if finished.finish_reason == scheduler_pb2.SCHEDULER_FINISH_REASON_ABORT:
                        yield Event(
                            cancelled=inference_pb2.Cancelled(
                                reason="abort", usage=progress.usage()
                            )
                        )
                    else:
                        reason = (
                            FINISH_REASONS[finished.finish_reason]
                            if stops.matched is None
                            else inference_pb2.FINISH_REASON_STOP_STRING
                        )
                        yield completed_event(
                            reason, stops.matched or "", finished, progress, admitted
                        )
                    return
                elif kind == "failed":
                    yield Event(usage=progress.usage())
                    yield Event(failed=inference_pb2.Failed(error=event.failed))
                    return
                else:
                    raise KvmeshError(Reason.WORKER_LOST, "the scheduler ended the stream early")
        except (grpc.RpcError, KvmeshError) as error:
            failure = upstream_failure(
                error if isinstance(error, KvmeshError) else grpc_errors.from_rpc_error(error),
                emitted=progress.first_token_at is not None,
            )
            log.warning("failed", extra={"reason": failure.reason.value, "error": failure.message})
            yield Event(usage=progress.usage())
            yield Event(failed=inference_pb2.Failed(error=grpc_errors.to_pb(failure)))
