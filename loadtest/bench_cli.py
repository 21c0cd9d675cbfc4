"""`kvmesh bench`: a workload against a running server, at one load or a sweep of them.

`kvmesh bench ARGS` runs `python -m loadtest.bench_cli ARGS`: the CLI names this module and
never imports it, so the `kvmesh` package does not depend on the benchmarks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvmesh import run_file
from loadtest.bench import BenchPlan, run, write_report
from loadtest.driver import LoadShape
from loadtest.report import DEFINITIONS, Slo, markdown_table
from loadtest.workload import Workload

DESCRIPTION = "A workload against kvmesh gRPC or any OpenAI HTTP API, at one load or a sweep."


def _numbers(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def build_parser() -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(prog="kvmesh bench", description=DESCRIPTION)
    bench.add_argument(
        "target",
        nargs="?",
        help="grpc://HOST:PORT (kvmesh) or http://HOST:PORT/v1 (OpenAI); default: the mesh "
        "`kvmesh up` started",
    )
    bench.add_argument(
        "--workload", default="sharegpt", help="a name in loadtest/workloads or a TOML path"
    )
    bench.add_argument("--requests", type=int, help="per load point (default: the workload's)")
    load = bench.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=_numbers, help="Poisson arrivals per second; a,b,c sweeps")
    load.add_argument("--concurrency", type=_numbers, help="requests in flight; a,b,c sweeps")
    bench.add_argument("--duration", type=float, help="seconds; no new request after it")
    bench.add_argument("--seed", type=int, default=0, help="arrival times")
    bench.add_argument("--slo-ttft-ms", type=float)
    bench.add_argument("--slo-tpot-ms", type=float)
    bench.add_argument("--slo-e2e-ms", type=float)
    bench.add_argument(
        "--out", help="directory for requests.jsonl, summary.jsonl, summary.md, PNGs"
    )
    bench.add_argument("--label", default="kvmesh", help="this run's name in the tables")
    bench.add_argument("--api-key")
    bench.add_argument("--model", default="", help="model name (default: the server's first)")
    bench.add_argument("--vocab-size", type=int, help="prompt ids range (asked of kvmesh gRPC)")
    bench.add_argument("--max-context", type=int, help="cap prompt + output (asked of kvmesh gRPC)")
    bench.add_argument("--no-progress", action="store_true")
    return bench


def _ms(value: float | None) -> float | None:
    return None if value is None else value / 1e3


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rate:
        loads = [
            LoadShape(rate=rate, duration_s=args.duration, seed=args.seed) for rate in args.rate
        ]
    else:
        loads = [
            LoadShape(concurrency=int(c), duration_s=args.duration, seed=args.seed)
            for c in args.concurrency
        ]
    plan = BenchPlan(
        target=args.target or f"grpc://{run_file.gateway(None)}",
        workload=Workload.load(args.workload),
        loads=loads,
        slo=Slo(_ms(args.slo_ttft_ms), _ms(args.slo_tpot_ms), _ms(args.slo_e2e_ms)),
        requests=args.requests,
        label=args.label,
        out_dir=Path(args.out) if args.out else None,
        api_key=args.api_key,
        model=args.model,
        vocab_size=args.vocab_size,
        max_context=args.max_context,
        progress=not args.no_progress,
    )
    result = run(plan)
    print(markdown_table(result.summaries))
    print(f"\nSLOs for goodput: {plan.slo.describe()}\n\n{DEFINITIONS}")
    if plan.out_dir is not None:
        report = write_report(plan.out_dir, result, f"{plan.label}: {plan.workload.name}")
        print(
            f"\nwritten: {plan.out_dir}/requests.jsonl, summary.jsonl, {report.name}, *.png",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
