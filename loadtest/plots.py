"""PNG plots of runs (matplotlib, drawn off-screen): latency distributions, latency against
offered rate (where the knee is), throughput against concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.driver import RunResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def distributions(runs: dict[str, RunResult], path: Path) -> Path:
    """TTFT and TPOT of completed requests, one cumulative curve per run."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, result in runs.items():
        done = [r for r in result.records if r.outcome == "completed"]
        for axis, values in (
            (axes[0], [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]),
            (axes[1], [r.tpot_s * 1e3 for r in done if r.tpot_s is not None]),
        ):
            if values:
                values.sort()
                axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    for axis, name in zip(axes, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        axis.set_xlabel(name)
        axis.set_ylabel("share of requests")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _by_label(summaries: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for summary in summaries:
        if summary.get(key) is not None:
            grouped.setdefault(summary["label"], []).append(summary)
    return grouped


def latency_vs_rate(summaries: list[dict[str, Any]], path: Path) -> Path:
    """TTFT p50/p99 and TPOT p50 against the offered rate, per run label."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in _by_label(summaries, "rate").items():
        points.sort(key=lambda s: s["rate"])
        rates = [s["rate"] for s in points]
        for q, style in (("p50", "-o"), ("p99", "--o")):
            axes[0].plot(
                rates, [s[f"ttft_{q}_ms"] or 0 for s in points], style, label=f"{label} {q}"
            )
        axes[1].plot(rates, [s["tpot_p50_ms"] or 0 for s in points], "-o", label=label)
    for axis, name in zip(axes, ("TTFT (ms)", "TPOT p50 (ms)"), strict=True):
        axis.set_xlabel("offered rate (requests/s)")
        axis.set_ylabel(name)
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def throughput_vs_concurrency(summaries: list[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, points in _by_label(summaries, "concurrency").items():
        points.sort(key=lambda s: s["concurrency"])
        axis.plot(
            [s["concurrency"] for s in points],
            [s["output_throughput"] for s in points],
            "-o",
            label=label,
        )
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("output tokens/s")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
