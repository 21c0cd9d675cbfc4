"""kvmesh's CPU engine against llama.cpp's C++ binaries, same model, machine and run
(`make bench-cpu`; a few minutes after llama.cpp's one-time build).

Engine level, as `llama-batched-bench` measures it: B sequences of 128-token prompts prefilled,
then 128 tokens decoded for all of them together; decode tok/s = generated tokens / decode
time. kvmesh: the in-process engine in each weight format asked for. llama.cpp: the shipped
Q4_1 file and an F32 GGUF of the same weights (`kvmesh convert`), `--no-repack`.
Serving level (`--levels serving`, or `engine,serving`): the mesh (`kvmesh up`) and
`llama-server --parallel 32`, 32 concurrent sharegpt streams from `kvmesh bench`'s driver:
throughput and TTFT p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import torch

from kvmesh.convert import gguf_to_f32
from kvmesh.engine import Engine
from kvmesh.mesh.compiled_steps import CompiledStepWatch
from kvmesh.mesh.launcher import Mesh, MeshConfig
from loadtest import llama_cpp
from loadtest.driver import LoadShape, run_load
from loadtest.report import Slo, summarize
from loadtest.targets import GrpcTarget, OpenAITarget
from loadtest.workload import Workload
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.model_paths import default_model_path
from shared.sampling import SamplingParams


def kvmesh_decode_tok_s(engine: Engine, batch: int, prompt: int, generated: int) -> float:
    rng = random.Random(batch)
    vocab = engine.worker.architecture.vocab_size
    params = SamplingParams(max_tokens=generated, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, vocab) for _ in range(prompt)], params)
    produced = 0
    while produced < batch:  # prefills (chunked as the scheduler chooses) and first tokens
        produced += sum(len(o.new_token_ids) for o in engine.step())
    started, decoded = time.perf_counter(), 0
    while engine.has_unfinished():
        decoded += sum(len(o.new_token_ids) for o in engine.step())
    return decoded / (time.perf_counter() - started)


def decode_engine(model: str | None, weights: str, threads: int) -> Engine:
    """The in-process engine the decode rows run on, its first-call costs out of the way."""
    engine = Engine(
        EngineConfig(
            model=model,
            weights=weights,
            num_threads=threads,
            cache=CacheConfig(kv_memory_bytes=1 << 30),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        )
    )
    kvmesh_decode_tok_s(engine, 1, 16, 4)
    return engine


def engine_level(args: argparse.Namespace, f32_path: str) -> dict:
    results: dict = {"kvmesh": {}, "llama.cpp": {}}
    for weights in args.weights:
        engine = decode_engine(None, weights, args.threads)
        rates = {}
        for batch in args.batches:
            rates[batch] = kvmesh_decode_tok_s(engine, batch, args.prompt, args.generated)
            print(f"kvmesh {weights:8s} batch {batch:3d}: {rates[batch]:7.1f} tok/s", flush=True)
        results["kvmesh"][weights] = rates
        del engine
    bin_dir = llama_cpp.build()
    for label, path in (("Q4_1", default_model_path()), ("F32", f32_path)):
        rows = llama_cpp.batched_bench(
            bin_dir, path, args.batches, args.prompt, args.generated, args.threads
        )
        results["llama.cpp"][label] = {r.batch: r.decode_tok_s for r in rows}
        for r in rows:
            print(
                f"llama.cpp {label:5s} batch {r.batch:3d}: {r.decode_tok_s:7.1f} tok/s", flush=True
            )
    return results


def engine_table(results: dict, batches: list[int]) -> str:
    header = "| decode tok/s | " + " | ".join(f"batch {b}" for b in batches) + " |"
    lines = [header, "|---" * (len(batches) + 1) + "|"]
    for peer in ("llama.cpp", "kvmesh"):
        for label, rates in results[peer].items():
            cells = " | ".join(f"{rates.get(b, float('nan')):.1f}" for b in batches)
            lines.append(f"| {peer} {label} | {cells} |")
    best_peer = {b: max(r.get(b, 0.0) for r in results["llama.cpp"].values()) for b in batches}
    for label, rates in results["kvmesh"].items():
        cells = " | ".join(f"{rates[b] / best_peer[b]:.2f}x" for b in batches)
        lines.append(f"| kvmesh {label} / best llama.cpp | {cells} |")
    return "\n".join(lines)


async def serving_level(args: argparse.Namespace, f32_path: str) -> list[dict]:
    workload = Workload.load("sharegpt")
    specs = workload.build(49152, args.requests, max_context=2048)
    shape = LoadShape(concurrency=args.concurrency)
    slo = Slo(3.0, 0.2)
    summaries = []
    config = MeshConfig(
        worker_threads=args.threads,
        worker_args=["--kv-memory", "1GiB", "--weights", args.serving_weights],
        log_dir=str(args.out / "logs"),
    )
    with Mesh(config) as mesh:
        CompiledStepWatch(mesh.services).wait(timeout_s=1800)
        async with GrpcTarget(mesh.gateway_address) as target:
            result = await run_load(target, specs, shape)
    summaries.append(summarize(f"kvmesh mesh ({args.serving_weights})", result, slo))
    bin_dir = llama_cpp.build()
    for label, path in (("Q4_1", default_model_path()), ("F32", f32_path)):
        log = args.out / "logs" / f"llama-server-{label}.log"
        context = args.concurrency * 2048
        with llama_cpp.server(bin_dir, path, args.concurrency, context, args.threads, log) as url:
            async with OpenAITarget(url, model="model", detokenize=_detokenizer()) as target:
                result = await run_load(target, specs, shape)
        summaries.append(
            summarize(f"llama-server --parallel {args.concurrency} {label}", result, slo)
        )
    return summaries


def _detokenizer():
    from shared.text_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    assert tokenizer is not None
    return tokenizer.decode


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 32]
    )
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--generated", type=int, default=128)
    parser.add_argument("--weights", type=lambda t: t.split(","), default=["float32", "packed"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--levels",
        type=lambda t: t.split(","),
        default=["engine"],
        help="engine, serving, or both (engine,serving)",
    )
    parser.add_argument("--serving-weights", default="auto", help="the mesh's --weights")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/cpu"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    f32_path = str(args.out / "smollm2-f32.gguf")
    if not os.path.exists(f32_path):
        gguf_to_f32(default_model_path(), f32_path)
    results = {}
    if "engine" in args.levels:
        results["engine"] = engine_level(args, f32_path)
        print(f"\n{engine_table(results['engine'], args.batches)}\n")
    if "serving" in args.levels:
        results["serving"] = asyncio.run(serving_level(args, f32_path))
        for s in results["serving"]:
            print(
                f"{s['label']}: {s['output_throughput']:.1f} out tok/s, outcomes "
                f"{s['outcomes']}, TTFT p99 {s['ttft_p99_ms'] or 0:.0f} ms"
            )
    (args.out / "cpu_bench.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
