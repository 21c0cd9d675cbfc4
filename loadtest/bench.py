"""One benchmark: a workload sent to a target at each load point of a sweep, every result
kept (per-request JSON lines, summaries, a Markdown table, plots). `kvmesh bench` and the
peer comparison (`make bench-peers`) both run through here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import plots
from loadtest.driver import LoadShape, RunResult, run_load
from loadtest.report import DEFINITIONS, Slo, markdown_table, summarize, write_results
from loadtest.targets import GrpcTarget, OpenAITarget, target_for
from loadtest.workload import Workload


@dataclass
class BenchPlan:
    target: str  # grpc://HOST:PORT or http(s)://HOST:PORT/v1
    workload: Workload
    loads: list[LoadShape]
    slo: Slo = field(default_factory=Slo)
    requests: int | None = None  # per load point; None: the workload's own count
    label: str = "kvmesh"
    out_dir: Path | None = None
    api_key: str | None = None
    model: str = ""
    vocab_size: int | None = None  # None: asked of a gRPC target, else 32000
    max_context: int | None = None  # None: asked of a gRPC target
    progress: bool = True


@dataclass
class BenchResult:
    summaries: list[dict[str, Any]]
    runs: dict[str, RunResult]  # by "label, load"


async def _limits(target: GrpcTarget | OpenAITarget, plan: BenchPlan) -> tuple[int, int | None]:
    vocab, context = plan.vocab_size, plan.max_context
    if isinstance(target, GrpcTarget) and (vocab is None or context is None):
        info = await target.model_info()
        vocab = vocab or info.vocab_size
        context = context or info.max_model_len
    return vocab or 32000, context


async def run_bench(plan: BenchPlan) -> BenchResult:
    summaries: list[dict[str, Any]] = []
    runs: dict[str, RunResult] = {}
    async with target_for(plan.target, plan.api_key, plan.model) as target:
        vocab, context = await _limits(target, plan)
        specs = plan.workload.build(vocab, plan.requests, context)
        for shape in plan.loads:
            result = await run_load(target, specs, shape, plan.progress)
            summary = summarize(plan.label, result, plan.slo)
            summary["workload"] = plan.workload.name
            summaries.append(summary)
            runs[f"{plan.label}, {shape.label}"] = result
            if plan.out_dir is not None:
                write_results(plan.out_dir, plan.label, result, summary)
    return BenchResult(summaries, runs)


def write_report(
    out_dir: Path, result: BenchResult, title: str, baseline: str | None = None
) -> Path:
    """summary.md (definitions, SLOs, the table) and the plots that the sweep allows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots.distributions(result.runs, out_dir / "latency_distributions.png")
    rates = {s["rate"] for s in result.summaries if s["rate"] is not None}
    concurrencies = {s["concurrency"] for s in result.summaries if s["concurrency"] is not None}
    if len(rates) > 1:
        plots.latency_vs_rate(result.summaries, out_dir / "latency_vs_rate.png")
    if len(concurrencies) > 1:
        plots.throughput_vs_concurrency(result.summaries, out_dir / "throughput_vs_concurrency.png")
    slo = result.summaries[0]["slo"] if result.summaries else "none"
    text = (
        f"# {title}\n\n{markdown_table(result.summaries, baseline)}\n\nSLOs for goodput: {slo}\n\n"
        f"{DEFINITIONS}\n"
    )
    path = out_dir / "summary.md"
    path.write_text(text, encoding="utf-8")
    return path


def run(plan: BenchPlan) -> BenchResult:
    return asyncio.run(run_bench(plan))
