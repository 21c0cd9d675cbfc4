"""kvmesh and what a user would run instead, on the same model, machine and workload, in one
run (`make bench-peers`; slow, not part of the tests).

Peers, one at a time so none shares the cores with another:
- kvmesh-mesh: the full mesh on loopback (gateway, tokenizer, scheduler, engine-worker, Redis)
  through the public gRPC API;
- kvmesh-engine: the in-process Engine;
- transformers: `generate` in static batches of the concurrency;
- llama.cpp-Q4_1 / llama.cpp-F32: llama.cpp's C++ `llama-server --parallel N` (continuous
  batching; built once by loadtest.llama_cpp) on the shipped GGUF and on an F32 GGUF of the
  same weights (`kvmesh convert`), prompts sent as text.
Each runs the sweep (closed loop at each concurrency, then open loop at each rate); the table
prints each peer's throughput, TTFT and TPOT percentiles, goodput, and kvmesh-mesh's throughput
ratio to it. Also measured: copy bandwidth, and batch-1 decode against weight bytes / bandwidth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy

from kvmesh.convert import gguf_to_f32
from kvmesh.engine import Engine
from kvmesh.mesh.compiled_steps import CompiledStepWatch
from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest import llama_cpp
from loadtest.bench import BenchResult, write_report
from loadtest.driver import LoadShape, RunResult, run_load
from loadtest.inprocess import EngineTarget, run_transformers
from loadtest.report import DEFINITIONS, Slo, markdown_table, summarize, write_results
from loadtest.targets import GrpcTarget, OpenAITarget
from loadtest.workload import RequestSpec, Workload
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.model_paths import default_model_path
from shared.sampling import SamplingParams
from shared.text_tokenizer import load_tokenizer

PEERS = ("kvmesh-mesh", "kvmesh-engine", "transformers", "llama.cpp-Q4_1", "llama.cpp-F32")
BASELINE = "kvmesh-mesh"


def copy_bandwidth_gb_s(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes read + written per second by one large copy (best of a few)."""
    source = numpy.ones(megabytes * 2**20 // 4, dtype=numpy.float32)
    target = numpy.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        numpy.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best / 1e9


def batch1_decode_tok_s(threads: int, tokens: int = 128) -> tuple[float, int]:
    engine = Engine(EngineConfig(num_threads=threads, cache=CacheConfig(kv_memory_bytes=256 << 20)))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate([[100 + i for i in range(16)]], SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request([200 + i for i in range(16)], params)
    engine.step()  # the prefill and the first token
    started = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - started), engine.worker.manifest.num_parameters


@dataclass
class Collector:
    """Every run's records and summary, kept and written as it finishes."""

    slo: Slo
    out_dir: Path
    runs: dict[str, RunResult] = field(default_factory=dict)
    summaries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, label: str, result: RunResult) -> None:
        summary = summarize(label, result, self.slo)
        write_results(self.out_dir, label, result, summary)
        self.summaries.append(summary)
        self.runs[f"{label}, {result.shape.label}"] = result
        print(
            f"{label}, {result.shape.label}: {summary['output_throughput']:.1f} tok/s, TTFT p50 "
            f"{summary['ttft_p50_ms'] or 0:.0f} ms, p99 {summary['ttft_p99_ms'] or 0:.0f} ms",
            flush=True,
        )


def requests_for(specs: list[RequestSpec], shape: LoadShape, requests: int) -> list[RequestSpec]:
    """The first `requests` of the workload, and at least one per concurrent stream."""
    return specs[: max(requests, shape.concurrency or 0)]


@contextlib.asynccontextmanager
async def peer_target(peer: str, args: argparse.Namespace, f32_path: str) -> AsyncIterator[Any]:
    model = default_model_path()
    if peer == "kvmesh-mesh":
        config = MeshConfig(
            worker_threads=args.threads,
            worker_args=["--kv-memory", "1GiB"],
            log_dir=str(args.out / "logs"),
        )
        with Mesh(config) as mesh:
            CompiledStepWatch(mesh.services).wait(timeout_s=1800)
            async with GrpcTarget(mesh.gateway_address) as target:
                yield target
    elif peer == "kvmesh-engine":
        engine = Engine(
            EngineConfig(
                num_threads=args.threads,
                cache=CacheConfig(kv_memory_bytes=1 << 30),
                scheduler=SchedulerConfig(max_num_seqs=256),
            )
        )
        async with EngineTarget(engine) as target:
            yield target
    else:
        tokenizer = load_tokenizer(model)
        assert tokenizer is not None
        path = model if peer == "llama.cpp-Q4_1" else f32_path
        parallel = max(args.concurrency)  # continuous batching over as many slots as streams
        log = args.out / "logs" / f"llama-server-{Path(path).stem}.log"
        bin_dir = llama_cpp.build()
        with llama_cpp.server(bin_dir, path, parallel, parallel * 2048, args.threads, log) as url:
            async with OpenAITarget(url, detokenize=tokenizer.decode) as target:
                yield target


async def run_peers(args: argparse.Namespace) -> BenchResult:
    workload = Workload.load(args.workload)
    specs = workload.build(49152, max(args.requests, *args.concurrency), max_context=2048)
    slo = Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    closed = [LoadShape(concurrency=c) for c in args.concurrency]
    opened = [LoadShape(rate=r, seed=1) for r in args.rates]
    collector = Collector(slo, args.out)
    f32_path = str(args.out / "smollm2-f32.gguf")
    if any(p.startswith("llama.cpp-F32") for p in args.peers) and not os.path.exists(f32_path):
        gguf_to_f32(default_model_path(), f32_path)
    for peer in args.peers:
        if peer == "transformers":  # static batches: closed loop only
            for shape in closed:
                result = await asyncio.to_thread(
                    run_transformers,
                    default_model_path(),
                    requests_for(specs, shape, args.requests),
                    shape.concurrency or 1,
                    args.threads,
                )
                collector.add(peer, result)
            continue
        async with peer_target(peer, args, f32_path) as target:
            for shape in closed + opened:
                collector.add(
                    peer, await run_load(target, requests_for(specs, shape, args.requests), shape)
                )
    return BenchResult(collector.summaries, collector.runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="sharegpt")
    parser.add_argument(
        "--requests", type=int, default=16, help="per load point (at least the concurrency)"
    )
    parser.add_argument(
        "--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 32, 64]
    )
    parser.add_argument(
        "--rates", type=lambda t: [float(x) for x in t.split(",") if x], default=[0.5, 1.0, 2.0]
    )
    parser.add_argument("--peers", type=lambda t: t.split(","), default=list(PEERS))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000)
    parser.add_argument("--slo-tpot-ms", type=float, default=200)
    parser.add_argument("--out", type=Path, default=Path("results/peers"))
    args = parser.parse_args()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth_gb_s()
    decode, parameters = batch1_decode_tok_s(args.threads)
    limit = bandwidth * 1e9 / (parameters * 4)
    result = asyncio.run(run_peers(args))
    report = write_report(
        args.out, result, f"Peers on {args.workload}, {os.cpu_count()} cores", BASELINE
    )
    print(f"\n{markdown_table(result.summaries, BASELINE)}\n\n{DEFINITIONS}")
    print(
        f"\ncopy bandwidth {bandwidth:.1f} GB/s; fp32 weights {parameters * 4 / 1e6:.0f} MB "
        f"read per token -> batch-1 limit {limit:.1f} tok/s; kvmesh batch-1 decode "
        f"{decode:.1f} tok/s = {limit / decode:.2f}x the limit's time per token (goal <= 1.3x)"
    )
    print(f"report: {report}", file=sys.stderr)


if __name__ == "__main__":
    main()
