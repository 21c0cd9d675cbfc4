"""Summaries of a run: latency percentiles, throughput, goodput against SLOs, and the files
(JSON lines, a Markdown table) they are written to. The definitions are printed with them."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.driver import RunResult

PERCENTILES = (50, 90, 95, 99)
DEFINITIONS = """\
Definitions (client-side times, from just before each request is sent):
- TTFT: to the first streamed event that carries a token; includes queueing, prefill, network.
- ITL: each gap between consecutive token-carrying events, pooled over all requests (a request
  with more tokens weighs more); an event carrying k tokens is one gap.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); percentiles are over requests.
- E2E: to the last event. Queue: the server's own queue time, where it reports one (kvmesh).
- Throughput: completed requests, and output tokens of all requests, per second of the run
  (first send to last answer).
- Goodput: the share of all sent requests that completed and met every SLO given, and that
  share's rate in requests per second."""


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, record: Any) -> bool:
        if record.outcome != "completed":
            return False
        checks = (
            (self.ttft_s, record.ttft_s),
            (self.tpot_s, record.tpot_s),
            (self.e2e_s, record.e2e_s),
        )
        return all(
            limit is None or (value is not None and value <= limit) for limit, value in checks
        )

    def describe(self) -> str:
        parts = [
            f"{name} <= {limit * 1e3:g} ms"
            for name, limit in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s), ("E2E", self.e2e_s))
            if limit is not None
        ]
        return " and ".join(parts) or "none (every completed request counts)"


def percentile(values: list[float], q: float) -> float | None:
    """Linear between order statistics (numpy's default), never beyond the data."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(label: str, result: RunResult, slo: Slo) -> dict[str, Any]:
    records = result.records
    completed = [r for r in records if r.outcome == "completed"]
    series = {
        "ttft": [r.ttft_s for r in completed if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in completed if r.tpot_s is not None],
        "itl": [gap for r in completed for gap in r.itl_s],
        "e2e": [r.e2e_s for r in completed],
        "queue": [r.queue_s for r in completed if r.queue_s is not None],
    }
    duration = max(result.duration_s, 1e-9)
    good = sum(1 for r in records if slo.met(r))
    summary: dict[str, Any] = {
        "label": label,
        "load": result.shape.label,
        "rate": result.shape.rate,
        "concurrency": result.shape.concurrency,
        "requests": len(records),
        "outcomes": dict(Counter(r.outcome for r in records)),
        "reasons": dict(
            Counter(f"{r.outcome}:{r.reason}" for r in records if r.outcome != "completed")
        ),
        "duration_s": result.duration_s,
        "request_throughput": len(completed) / duration,
        "output_throughput": sum(r.output_tokens for r in records) / duration,
        "goodput_share": good / max(1, len(records)),
        "goodput_rps": good / duration,
        "slo": slo.describe(),
    }
    for name, values in series.items():
        for q in PERCENTILES:
            value = percentile(values, q)
            summary[f"{name}_p{q}_ms"] = None if value is None else value * 1e3
    return summary


def write_results(out_dir: Path, label: str, result: RunResult, summary: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "a", encoding="utf-8") as handle:
        for record in result.records:
            handle.write(json.dumps({"label": label, **record.to_json()}) + "\n")
    with open(out_dir / "summary.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(summary) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown_table(summaries: list[dict[str, Any]], baseline: str | None = None) -> str:
    """One row per run; with `baseline` (a label), each row's throughput ratio to it under the
    same load."""
    header = (
        "| run | load | done/sent | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
        "| ITL p99 | goodput |"
    )
    lines = [header, "|" + " --- |" * 11]
    base = {s["load"]: s for s in summaries if s["label"] == baseline}
    for s in summaries:
        ratio = ""
        reference = base.get(s["load"])
        if reference is not None and s is not reference and reference["output_throughput"]:
            times = reference["output_throughput"] / max(s["output_throughput"], 1e-9)
            ratio = f" ({baseline}: {times:.2f}x)"
        done = s["outcomes"].get("completed", 0)
        cells = [
            s["label"],
            s["load"],
            f"{done}/{s['requests']}",
            f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}{ratio}",
            *(_ms(s[key]) for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")),
            _ms(s["itl_p99_ms"]),
            f"{s['goodput_share'] * 100:.0f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
