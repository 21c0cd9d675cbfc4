"""One Generate request's telemetry: the root of its trace, its phases' spans, and (through
request_metrics.py) its Prometheus series.

The root span `kvmesh.Generate` (a child of the client's `traceparent` when it sent one) spans
the whole stream; the gateway's phases are its children: admission (auth and input checks),
tokenize, rate_limit, route, detokenize (the Detokenize stream's life) and delivery (first
delta to terminal event). Scheduler and engine-worker spans join through the context passed in
the gRPC metadata of each outgoing call. Inter-token gaps are attributes of the root, never a
span per token. Prompt and completion text enter the trace only with --trace-content.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.gateway.request.request_metrics import RequestMetrics
from shared.errors import KvmeshError
from shared.runtime.telemetry import (
    context_from_metadata,
    metadata_for,
    trace_id_hex,
    traceparent_of,
)

tracer = trace.get_tracer("kvmesh.gateway")
# A long answer's gaps beyond this are summarised by the histogram only.
MAX_GAPS_IN_SPAN = 4096
MAX_CONTENT_CHARS = 4096


class RequestTelemetry:
    def __init__(
        self,
        request_id: str,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        operation: str,
        record_content: bool = False,
    ) -> None:
        received = time.monotonic()
        self.record_content = record_content
        self.root = tracer.start_span(
            "kvmesh.Generate",
            context=context_from_metadata(metadata),
            kind=SpanKind.SERVER,
            attributes={
                "kvmesh.request_id": request_id,
                "gen_ai.operation.name": operation,
                "rpc.system": "grpc",
                "rpc.service": "kvmesh.v1.Inference",
                "rpc.method": "Generate",
            },
        )
        self.trace_id = trace_id_hex(self.root)
        self._parent = trace.set_span_in_context(self.root)
        self.metrics = RequestMetrics(self.trace_id, received)
        self._gaps_ms: list[float] = []
        self._completion: list[str] = []
        self._delivery: trace.Span | None = None
        self._delivery_blocked_s = 0.0
        self._detokenize: trace.Span | None = None
        self._ended = False

    # ---- spans for the gateway's phases ----------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[trace.Span]:
        span = tracer.start_span(name, context=self._parent)
        try:
            yield span
        except KvmeshError as error:
            span.set_status(Status(StatusCode.ERROR, error.reason.value))
            raise
        finally:
            span.end()

    @staticmethod
    def phase_metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
        """For a call made within a phase: the callee's span becomes the phase's child."""
        return metadata_for(span)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """For calls whose server spans are children of the root (Submit)."""
        return metadata_for(self.root)

    def detokenize_traceparent(self) -> str:
        """Opens the detokenize span; the tokenizer's span for each completion's lane becomes
        its child."""
        self._detokenize = tracer.start_span("detokenize", context=self._parent)
        return traceparent_of(self._detokenize)

    def detokenize_ended(self, wait_s: float) -> None:
        if self._detokenize is not None:
            self._detokenize.set_attribute("kvmesh.detokenize.wait_ms", wait_s * 1e3)
            self._detokenize.end()
            self._detokenize = None

    # ---- what happened ---------------------------------------------------------------------

    def prompt(self, text: str) -> None:
        if self.record_content and text:
            self.root.set_attribute("gen_ai.prompt", text[:MAX_CONTENT_CHARS])

    def admitted(self, attributes: dict[str, str | int | float]) -> None:
        self.metrics.admitted(str(attributes.get("gen_ai.response.model", "")))
        self.root.set_attributes(attributes)

    def end_user(self, digest: str) -> None:
        self.root.set_attribute("kvmesh.end_user", digest)

    def event(self, name: str, attributes: dict[str, str]) -> None:
        """Something that happened to the request: an event on its root span, and counted."""
        self.root.add_event(name, attributes)
        self.metrics.event(name)

    def delta(self, text: str, num_tokens: int) -> None:
        """A delta is about to be sent; the first one starts the delivery span."""
        now = time.monotonic()
        if self.record_content:
            self._completion.append(text)
        if num_tokens == 0:
            return
        gap_s = self.metrics.delta(now)
        if gap_s is None:
            self.root.add_event("first_token")
            self._delivery = tracer.start_span("delivery", context=self._parent)
        elif len(self._gaps_ms) < MAX_GAPS_IN_SPAN:
            self._gaps_ms.append(round(gap_s * 1e3, 3))

    def blocked_sending(self, seconds: float) -> None:
        """Time a send waited for the client (gRPC flow control) counts as delivery."""
        self._delivery_blocked_s += seconds

    def rejected(self, error: KvmeshError) -> None:
        self.metrics.rejected(error.reason.value)
        self.root.set_attribute("kvmesh.error.reason", error.reason.value)
        self._end(Status(StatusCode.ERROR, error.reason.value))

    def ended(self, outcome: str, reason: str, prompt_tokens: int, output_tokens: int) -> None:
        """The terminal event (or the client's disconnect): outcome, usage and the metrics."""
        if self._ended:
            return
        self.metrics.ended(outcome, reason, output_tokens)
        self.root.set_attributes(
            {
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.response.finish_reasons": [reason],
                "kvmesh.outcome": outcome,
                "kvmesh.itl_ms": self._gaps_ms,
            }
        )
        if self.record_content:
            completion = "".join(self._completion)[:MAX_CONTENT_CHARS]
            self.root.set_attribute("gen_ai.completion", completion)
        status = Status(StatusCode.ERROR, reason) if outcome == "failed" else Status(StatusCode.OK)
        self._end(status)

    def _end(self, status: Status) -> None:
        self._ended = True
        self.detokenize_ended(0.0)
        if self._delivery is not None:
            self._delivery.set_attribute(
                "kvmesh.delivery.blocked_ms", self._delivery_blocked_s * 1e3
            )
            self._delivery.end()
        self.root.set_status(status)
        self.root.end()


def span_seed(seed: int) -> int | str:
    """A seed as a span attribute: OTLP integers are signed 64-bit, and a seed may use all 64
    bits (a larger one would fail the whole export batch), so those go as text."""
    return seed if seed < 1 << 63 else str(seed)
