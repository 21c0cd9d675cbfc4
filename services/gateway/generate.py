"""One Generate stream's lifecycle: admit, announce, relay, clean up.

Admission (admission.py) either refuses, raising KvmeshError before the first event, or returns
the accepted request. Then the `accepted` event, the relay of the scheduler's events
(relay.py), and, however the stream ends, one cleanup: the upstream call cancelled (aborting
the request if it still runs), the rate-limit charge returned, the telemetry closed.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from services.gateway.admission import Admission, GenerateCall
from services.gateway.call_context import CallContext
from services.gateway.catalog import ModelCatalog
from services.gateway.policy import GatewayPolicy
from services.gateway.relay import FailOver, Relay
from services.gateway.request_record import (
    ActiveRequest,
    Admitted,
    Progress,
    accepted_event,
    terminal_reason,
)
from services.gateway.request_telemetry import RequestTelemetry
from services.gateway.stall import ClientStalled
from services.gateway.text_stream import TextStream
from services.gateway.tokenizer_link import TokenizerLink
from shared.errors import KvmeshError
from shared.logs import bind_request
from shared.pb.kvmesh.v1 import inference_pb2
from shared.service import ServiceRuntime

log = logging.getLogger("kvmesh.gateway")
Event = inference_pb2.GenerateEvent
TERMINAL = ("completed", "cancelled", "failed")
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

    @property
    def active(self) -> dict[tuple[str, str], ActiveRequest]:
        """Open requests by (tenant, request id): a tenant sees and aborts only its own."""
        return self.admission.active

    def _start(self, request: inference_pb2.GenerateRequest, context: CallContext) -> GenerateCall:
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
        except KvmeshError as error:
            telemetry.rejected(error)
            raise  # before the first event: the front turns it into a status
        except BaseException:
            telemetry.ended("cancelled", "client_disconnected", 0, 0)
            raise
        self._log_accepted(call, admitted)
        active_key = (admitted.tenant.name, call.request_id)
        self.active[active_key] = ActiveRequest(admitted.backend, admitted.upstream_id)
        progress = Progress(len(admitted.token_ids), call.received)
        text = TextStream(self.tokenizer.stub, telemetry.detokenize_metadata(), admitted.model.name)
        placed = [admitted]  # the current attempt last: a fail-over appends the next one
        outcome, reason = "cancelled", "client_disconnected"  # unless a terminal event is sent
        with self.runtime.in_flight():
            try:
                yield accepted_event(call.request_id, admitted, telemetry.trace_id)
                async for event in self._relayed(call, placed, text, progress, active_key):
                    kind = event.WhichOneof("event")
                    if kind == "delta":
                        telemetry.delta(event.delta.text, len(event.delta.token_ids))
                    elif kind in TERMINAL:
                        outcome, reason = kind, terminal_reason(event)
                        self._log_terminal(kind, progress)
                    sending = time.monotonic()
                    yield event
                    telemetry.blocked_sending(time.monotonic() - sending)
            except ClientStalled:  # thrown in by the front whose write stayed blocked
                outcome, reason = "cancelled", "client_stalled"
                log.info("client stalled: cancelled")
                raise
            finally:
                admitted = placed[-1]
                admitted.submit.cancel()  # a no-op when it ended; else the scheduler aborts it
                text.cancel()
                self.active.pop(active_key, None)
                admitted.routed.ended()
                total_tokens = progress.prompt_tokens + progress.completion_tokens
                self.admission.release(admitted.grant, total_tokens)
                telemetry.detokenize_ended(text.wait_s)
                telemetry.ended(outcome, reason, progress.prompt_tokens, progress.completion_tokens)

    async def _relayed(
        self,
        call: GenerateCall,
        placed: list[Admitted],
        text: TextStream,
        progress: Progress,
        active_key: tuple[str, str],
    ) -> AsyncIterator[Event]:
        """The relay's events; a retryable failure before the first token places the request
        once more, on another scheduler, and relays that attempt instead."""
        while True:
            admitted = placed[-1]
            relay = Relay(list(call.request.stop), admitted, text, progress)
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
            self.active[active_key] = ActiveRequest(moved.backend, moved.upstream_id)
            self._log_fail_over(call, admitted, moved, error)

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
        log.info(
            "accepted",
            extra={
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
    def _log_terminal(kind: str, progress: Progress) -> None:
        first_token_at = progress.first_token_at or progress.received
        log.info(
            kind,
            extra={
                "completion_tokens": progress.completion_tokens,
                "ttft_ms": round((first_token_at - progress.received) * 1e3, 2),
            },
        )
