"""One Generate request's Prometheus series: outcomes, streams in flight, and the latency
histograms (TTFT, TPOT, ITL, end to end), each observation carrying its trace id as an
exemplar. The request's spans are request_telemetry.py's."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from shared.runtime.metrics import REQUEST_SECONDS, TOKEN_SECONDS, exemplar

REQUESTS = Counter(
    "kvmesh_requests",
    "Requests by how they ended (rejected, completed, cancelled, failed)",
    ["outcome", "reason"],
)
ADMITTED = Counter("kvmesh_admitted", "Requests a scheduler accepted")
GENERATION_TOKENS = Counter(
    "kvmesh_generation_tokens", "Tokens this gateway streamed to clients, counted as each ended"
)
EVENTS = Counter("kvmesh_request_events", "Things that happened to requests (fail_over)", ["event"])
IN_FLIGHT = Gauge("kvmesh_gateway_requests_in_flight", "Generate streams open on this gateway")
TTFT = Histogram(
    "kvmesh_time_to_first_token_seconds",
    "Request received to first delta sent",
    ["model"],
    buckets=REQUEST_SECONDS,
)
TPOT = Histogram(
    "kvmesh_time_per_output_token_seconds",
    "Mean time per output token after the first",
    ["model"],
    buckets=TOKEN_SECONDS,
)
ITL = Histogram(
    "kvmesh_inter_token_latency_seconds",
    "Time between consecutive deltas",
    ["model"],
    buckets=TOKEN_SECONDS,
)
E2E = Histogram(
    "kvmesh_e2e_request_latency_seconds",
    "Request received to terminal event sent",
    ["model"],
    buckets=REQUEST_SECONDS,
)


class RequestMetrics:
    """The request's clock: when it arrived, its first and latest delta."""

    def __init__(self, trace_id: str, received: float) -> None:
        self.received = received  # time.monotonic() when the call arrived
        self.first_delta: float | None = None
        self.last_delta: float | None = None
        self.model = ""  # the latency histograms' label, once a scheduler accepted it
        self._exemplar = exemplar(trace_id)
        self._itl: Any = None  # ITL's series for the model, looked up on the first gap
        self._slowest_gap_s = 0.0
        IN_FLIGHT.inc()

    def admitted(self, model: str) -> None:
        ADMITTED.inc()
        self.model = model

    @staticmethod
    def event(name: str) -> None:
        EVENTS.labels(name).inc()

    def delta(self, now: float) -> float | None:
        """A delta with tokens is being sent at `now`; the gap since the previous one."""
        previous, self.last_delta = self.last_delta, now
        if previous is None:
            self.first_delta = now
            return None
        gap_s = now - previous
        # The exemplar marks the request's slowest gap so far: a bucket's trace then really
        # had such a gap, for a few observations a request (2 µs each) instead of every one.
        if gap_s > self._slowest_gap_s:
            self._slowest_gap_s = gap_s
            self._series().observe(gap_s, self._exemplar)
        else:
            self._series().observe(gap_s)
        return gap_s

    def _series(self) -> Any:
        if self._itl is None:
            self._itl = ITL.labels(self.model)
        return self._itl

    def rejected(self, reason: str) -> None:
        REQUESTS.labels("rejected", reason).inc()
        IN_FLIGHT.dec()

    def ended(self, outcome: str, reason: str, output_tokens: int) -> None:
        REQUESTS.labels(outcome, reason).inc()
        IN_FLIGHT.dec()
        GENERATION_TOKENS.inc(output_tokens)
        E2E.labels(self.model).observe(time.monotonic() - self.received, self._exemplar)
        if self.first_delta is None:
            return
        TTFT.labels(self.model).observe(self.first_delta - self.received, self._exemplar)
        if output_tokens > 1 and self.last_delta is not None:
            per_token = (self.last_delta - self.first_delta) / (output_tokens - 1)
            TPOT.labels(self.model).observe(per_token, self._exemplar)
