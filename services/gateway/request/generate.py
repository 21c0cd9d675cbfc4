"""One Generate stream's lifecycle: admit, announce, relay, clean up.

Admission (admission.py) either refuses, raising KvmeshError before the first event, or returns
the accepted request. Then the `accepted` event, the relay of the scheduler's events
(relay.py), and, however the stream ends, one cleanup: the upstream call cancelled (aborting
the request if it still runs), the rate-limit charge returned, the telemetry closed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.mesh.tokenizer_link import TokenizerLink
from services.gateway.policy.policy import GatewayPolicy
from services.gateway.policy.stall import ClientStalled
from services.gateway.request.admission import Admission
from services.gateway.request.call_context import CallContext, text_sink
from services.gateway.request.completions import Completion, merged
from services.gateway.request.generate_call import GenerateCall
from services.gateway.request.parked_relays import StepPass
from services.gateway.request.relay import FailOver, Park, Relay
from services.gateway.request.request_record import (
    ActiveRequest,
    Admitted,
    Progress,
    accepted_event,
    terminal_reason,
)
from services.gateway.request.request_telemetry import RequestTelemetry
from services.gateway.request.text_stream import TextStream
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import inference_pb2, scheduler_pb2
from shared.runtime.logs import bind_request
from shared.runtime.service import ServiceRuntime
from shared.tenants import end_user_digest

log = logging.getLogger("kvmesh.gateway")
Event = inference_pb2.GenerateEvent
TERMINAL = ("completed", "cancelled", "failed")
MAX_REQUEST_ID_CHARS = 256  # a client id is a key and a log field, not a payload
MAX_ATTEMPTS = 2  # the first placement and one fail-over


class GenerateHandler:
    def __init__(
        self,
        runtime: ServiceRuntime,
        catalog: ModelCatalog,
        tokenizer: TokenizerLink,
        policy: GatewayPolicy | None = None,
    ) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.policy = policy or GatewayPolicy()
        self.admission = Admission(runtime, catalog, tokenizer, self.policy)
        self.step_pass = StepPass()

    @property
    def active(self) -> dict[tuple[str, str], list[ActiveRequest]]:
        """Open requests by (tenant, request id), a placement per completion: a tenant sees
        and aborts only its own."""
        return self.admission.active

    def _start(self, request: inference_pb2.GenerateRequest, context: CallContext) -> GenerateCall:
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # before any log line carries it
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"request_id is {len(request.request_id)} characters; at most "
                f"{MAX_REQUEST_ID_CHARS}",
            )
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        bind_request(request_id)
        telemetry = RequestTelemetry(
            request_id,
            context.invocation_metadata(),
            "chat" if request.WhichOneof("input") == "chat" else "text_completion",
            self.policy.trace_content,
        )
        return GenerateCall(request, context, request_id, time.monotonic(), telemetry)

    async def __call__(
        self, request: inference_pb2.GenerateRequest, context: CallContext
    ) -> AsyncGenerator[Event, None]:
        """The request's events. A refusal raises KvmeshError before the first event; once
        `accepted` is out, every failure is a `failed` event and exactly one terminal event
        ends the stream. Closing the iterator early cancels the request upstream."""
        call = self._start(request, context)
        telemetry = call.telemetry
        try:
            admitted = await self.admission.admit(call)
            members = [admitted]
            if request.n > 1:  # the other completions, on the same scheduler
                members = await self.admission.admit_siblings(call, admitted)
        except KvmeshError as error:
            self.policy.request_ids.release(call.claim)
            telemetry.rejected(error)
            raise  # before the first event: the front turns it into a status
        except BaseException:
            self.policy.request_ids.release(call.claim)
            telemetry.ended("cancelled", "client_disconnected", 0, 0)
            raise
        self._log_accepted(call, admitted)
        active_key = (admitted.tenant.name, call.request_id)
        self.active[active_key] = [ActiveRequest(m.backend, m.upstream_id) for m in members]
        traceparent = telemetry.detokenize_traceparent()
        completions = [
            Completion(
                member.index,
                [member],  # the current attempt last: a fail-over appends the next one
                TextStream(self.tokenizer.lanes, member.model.name, traceparent),
                Progress(len(member.token_ids), call.received),
            )
            for member in members
        ]
        # Unless every completion sends its terminal event; with n > 1 the worst one counts.
        outcome, reason = "cancelled", "client_disconnected"
        ended: list[tuple[int, str, str]] = []
        with self.runtime.in_flight():
            try:
                yield accepted_event(call.request_id, admitted, telemetry.trace_id)
                relay = functools.partial(self._relayed, call, active_key=active_key)
                events = contextlib.aclosing(merged(completions, relay))
                async with events as relayed:  # closed (its tasks cancelled) however we leave
                    async for completion, event in relayed:
                        kind = event.WhichOneof("event")
                        if kind == "delta":
                            telemetry.delta(event.delta.text, len(event.delta.token_ids))
                        elif kind in TERMINAL:
                            ended.append((TERMINAL.index(kind), kind, terminal_reason(event)))
                            if kind == "failed":
                                failures = self.policy.tenant_failures
                                failures.record(admitted.tenant.name, event.failed.error.reason)
                            self._log_terminal(kind, completion)
                        event.index = completion.index
                        sending = time.monotonic()
                        yield event
                        telemetry.blocked_sending(time.monotonic() - sending)
                if len(ended) == len(completions):
                    _, outcome, reason = max(ended)
            except ClientStalled:  # thrown in by the front whose write stayed blocked
                outcome, reason = "cancelled", "client_stalled"
                log.info("client stalled: cancelled")
                raise
            finally:
                for completion in completions:
                    # A no-op when it ended; else the scheduler aborts it.
                    completion.admitted.submit.cancel()
                    completion.text.cancel()
                    completion.admitted.routed.ended()
                self.active.pop(active_key, None)
                self.policy.request_ids.release(call.claim)
                prompt_tokens = len(admitted.token_ids)
                output_tokens = sum(c.progress.completion_tokens for c in completions)
                self.admission.release(admitted.grant, prompt_tokens + output_tokens)
                telemetry.detokenize_ended(sum(c.text.wait_s for c in completions))
                telemetry.ended(outcome, reason, prompt_tokens, output_tokens)

    async def _relayed(
        self, call: GenerateCall, completion: Completion, active_key: tuple[str, str]
    ) -> AsyncIterator[Event]:
        """The relay's events; a retryable failure before the first token places the
        completion once more, on another scheduler, and relays that attempt instead."""
        placed, text, progress = completion.placed, completion.text, completion.progress

        async def hand_over(
            prefilled: Admitted, ticket: scheduler_pb2.HandoverTicket, first_ids: list[int]
        ) -> Admitted:
            moved = await self.admission.hand_over(call, prefilled, ticket, first_ids)
            placed.append(moved)  # cancelled, and counted, as the current placement
            if active := self.active.get(active_key):
                active[completion.index] = ActiveRequest(moved.backend, moved.upstream_id)
            return moved

        park = self._park(call, completion.index)
        while True:
            admitted = placed[-1]
            stops = list(call.request.stop)
            relay = Relay(stops, admitted, text, progress, call.tools, hand_over, park)
            relay.may_fail_over = len(admitted.attempts) < MAX_ATTEMPTS
            try:
                async for event in relay.events():
                    yield event
                return
            except FailOver as failed:
                error = failed.error
            admitted.submit.cancel()
            admitted.routed.ended()
            try:
                moved = await self.admission.fail_over(call, admitted, error)
            except KvmeshError:
                async for event in relay.on_broken(error):
                    yield event
                return
            placed.append(moved)
            if active := self.active.get(active_key):
                active[completion.index] = ActiveRequest(moved.backend, moved.upstream_id)
            self._log_fail_over(call, admitted, moved, error)

    def _park(self, call: GenerateCall, index: int) -> Park | None:
        """Where the caller takes plain text deltas at once, a relay parks past its first
        delta and the step pass relays its tokens (parked_relays.py)."""
        sink = text_sink(call.context)
        if sink is None:
            return None
        telemetry = call.telemetry

        def deliver(text: str, num_tokens: int) -> bool:
            if not sink(index, text, num_tokens):
                return False
            telemetry.delta(text, num_tokens)
            return True

        return self.step_pass.park(deliver)

    @staticmethod
    def _log_fail_over(
        call: GenerateCall, failed: Admitted, moved: Admitted, error: KvmeshError
    ) -> None:
        attributes = {
            "kvmesh.attempt.failed": failed.attempts[-1].attempt_id,
            "kvmesh.attempt.next": moved.attempts[-1].attempt_id,
            "kvmesh.attempt.failed_scheduler": failed.backend.address,
            "kvmesh.attempt.scheduler": moved.backend.address,
            "kvmesh.attempt.error_reason": error.reason.value,
        }
        call.telemetry.event("fail_over", attributes)
        log.warning("failed over before the first token", extra=attributes)

    @staticmethod
    def _log_accepted(call: GenerateCall, admitted: Admitted) -> None:
        route = admitted.routed.route
        end_user = end_user_digest(admitted.tenant.name, call.request.user)
        if end_user:
            call.telemetry.end_user(end_user)
        log.info(
            "accepted",
            extra={
                "end_user": end_user,
                "tenant": admitted.tenant.name,
                "prompt_tokens": len(admitted.token_ids),
                "queue_position": admitted.queue_position,
                "scheduler": admitted.backend.address,
                "matched_blocks": route.matched_blocks,
                "route_reason": route.reason,
                "trace_id": call.telemetry.trace_id,
            },
        )

    @staticmethod
    def _log_terminal(kind: str, completion: Completion) -> None:
        progress = completion.progress
        first_token_at = progress.first_token_at or progress.received
        log.info(
            kind,
            extra={
                "index": completion.index,
                "completion_tokens": progress.completion_tokens,
                "ttft_ms": round((first_token_at - progress.received) * 1e3, 2),
            },
        )
