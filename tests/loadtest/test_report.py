"""Percentiles as numpy computes them, TPOT and goodput by their definitions, and the table."""

from __future__ import annotations

import numpy
import pytest

from loadtest.driver import LoadShape, RunResult
from loadtest.report import Slo, markdown_table, percentile, summarize
from loadtest.targets import RequestRecord


def record(
    index: int, ttft: float, e2e: float, tokens: int, outcome: str = "completed"
) -> RequestRecord:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestRecord(index, 10, 0.0, outcome, "length", tokens, ttft, e2e, gaps)


def test_percentile_matches_numpy_linear() -> None:
    values = list(numpy.random.default_rng(0).exponential(1.0, 37))
    for q in (0, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(numpy.percentile(values, q))
    assert percentile([], 50) is None


def test_summary_throughput_tpot_and_goodput() -> None:
    records = [
        record(0, 0.5, 2.5, 21),  # TPOT 100 ms: meets TTFT <= 1 s and TPOT <= 100 ms
        record(1, 1.5, 3.5, 21),  # TTFT too slow
        record(2, 0.2, 4.2, 21),  # TPOT 200 ms
        record(3, 0.1, 0.3, 1, outcome="failed"),
    ]
    result = RunResult(records, duration_s=4.0, shape=LoadShape(concurrency=4))
    summary = summarize("kvmesh", result, Slo(ttft_s=1.0, tpot_s=0.1))
    assert summary["outcomes"] == {"completed": 3, "failed": 1}
    assert summary["request_throughput"] == pytest.approx(3 / 4.0)
    assert summary["output_throughput"] == pytest.approx(64 / 4.0)
    assert summary["goodput_share"] == pytest.approx(1 / 4) and summary[
        "goodput_rps"
    ] == pytest.approx(0.25)
    assert summary["tpot_p50_ms"] == pytest.approx(100.0)
    assert summary["ttft_p50_ms"] == pytest.approx(500.0)
    assert summary["concurrency"] == 4 and summary["rate"] is None
    assert summary["slo"] == "TTFT <= 1000 ms and TPOT <= 100 ms"
    table = markdown_table(
        [summary, {**summary, "label": "peer", "output_throughput": 8.0}], "kvmesh"
    )
    assert "| kvmesh | concurrency 4 | 3/4 |" in table
    assert "(kvmesh: 2.00x)" in table  # kvmesh's throughput over the peer's, same load
