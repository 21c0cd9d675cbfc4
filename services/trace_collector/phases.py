"""A request's phases from its trace, and percentiles over many requests.

The gateway's root span `kvmesh.Generate` gives E2E, TTFT (its `first_token` event), output
tokens and the gaps between deltas (`kvmesh.itl_ms`); the phase spans give queue, tokenize,
prefill (every chunk summed) and decode. A trace without its root (the gateway's batch not
arrived yet, or evicted) has no timing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.trace_collector.span_store import StoredTrace

ROOT_SPAN = "kvmesh.Generate"
PHASES = ("queue", "tokenize", "prefill", "decode", "ttft", "tpot", "itl", "e2e")


@dataclass
class RequestTiming:
    request_id: str
    trace_id: str
    model: str
    start_ns: int
    e2e_ms: float
    ttft_ms: float | None
    tpot_ms: float | None
    queue_ms: float | None
    tokenize_ms: float | None
    prefill_ms: float | None
    decode_ms: float | None
    output_tokens: int
    outcome: str
    finish_reason: str
    itl_ms: list[float] = field(default_factory=list)

    def phase_ms(self, phase: str) -> float | None:
        return self.e2e_ms if phase == "e2e" else getattr(self, f"{phase}_ms", None)


def _total_ms(trace: StoredTrace, name: str) -> float | None:
    durations = [span.duration_ms for span in trace.named(name)]
    return sum(durations) if durations else None


def request_timing(trace: StoredTrace) -> RequestTiming | None:
    root = trace.first(ROOT_SPAN)
    if root is None:
        return None
    first_token_ns = next((t for name, t in root.events if name == "first_token"), None)
    output_tokens = root.attributes.get("gen_ai.usage.output_tokens", 0)
    output_tokens = output_tokens if isinstance(output_tokens, int) else 0
    itl = root.attributes.get("kvmesh.itl_ms", [])
    gaps = [float(g) for g in itl] if isinstance(itl, list) else []
    reasons = root.attributes.get("gen_ai.response.finish_reasons", [])
    return RequestTiming(
        request_id=trace.request_id,
        trace_id=trace.trace_id,
        model=str(root.attributes.get("gen_ai.request.model", "")),
        start_ns=root.start_ns,
        e2e_ms=root.duration_ms,
        ttft_ms=None if first_token_ns is None else (first_token_ns - root.start_ns) / 1e6,
        tpot_ms=sum(gaps) / (output_tokens - 1) if gaps and output_tokens > 1 else None,
        queue_ms=_total_ms(trace, "queue"),
        tokenize_ms=_total_ms(trace, "tokenize"),
        prefill_ms=_total_ms(trace, "prefill"),
        decode_ms=_total_ms(trace, "decode"),
        output_tokens=output_tokens,
        outcome=str(root.attributes.get("kvmesh.outcome", "rejected")),
        finish_reason=str(reasons[0]) if isinstance(reasons, list) and reasons else "",
        itl_ms=gaps,
    )


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


@dataclass(frozen=True)
class PhaseSummary:
    phase: str
    count: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def summarize(timings: Iterable[RequestTiming]) -> list[PhaseSummary]:
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for timing in timings:
        for phase in PHASES:
            if phase == "itl":
                samples[phase].extend(timing.itl_ms)
                continue
            value = timing.phase_ms(phase)
            if value is not None:
                samples[phase].append(value)
    summaries = []
    for phase, values in samples.items():
        values.sort()
        summaries.append(
            PhaseSummary(
                phase,
                len(values),
                percentile(values, 50),
                percentile(values, 95),
                percentile(values, 99),
                values[-1] if values else 0.0,
            )
        )
    return summaries
