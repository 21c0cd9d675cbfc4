"""Where one decode step goes: a torch profiler table of a steady decode batch, by op.

Runs the in-process engine on the default model (or --model), fills a batch of `--batch`
requests with 128-token prompts, lets them decode, then profiles `--steps` decode steps and
prints the ops by self CPU time, the step time, and what share of it the matmuls take.
Run: python -m loadtest.step_profile --batch 1 [--weights packed|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvmesh.engine import Engine
from shared.config import WEIGHT_FORMATS, CacheConfig, EngineConfig
from shared.sampling import SamplingParams

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "quantized::", "kvmesh::")


def steady_engine(args: argparse.Namespace) -> Engine:
    engine = Engine(
        EngineConfig(
            model=args.model,
            weights=args.weights,
            num_threads=args.threads,
            cache=CacheConfig(kv_memory_bytes=512 << 20),
        )
    )
    rng = random.Random(0)
    vocab = engine.worker.architecture.vocab_size
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request([rng.randrange(100, vocab) for _ in range(128)], params)
    while any(r.num_computed_tokens < r.prompt_len for r in engine.worker.requests.values()) or (
        not engine.worker.requests
    ):
        engine.step()  # prefills: profile decodes only
    for _ in range(4):
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--weights", default="auto", choices=["auto", *WEIGHT_FORMATS])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=15, help="ops listed")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = steady_engine(args)
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - started) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key.startswith(MATMUL_OPS))
    calls = sum(e.count for e in events if e.key.startswith("aten::")) / args.steps
    print(f"weights {engine.worker.manifest.weights}, batch {args.batch}, {args.threads} threads")
    print(
        f"step {step_ms:.1f} ms unprofiled ({args.batch / step_ms * 1e3:.1f} tok/s); "
        f"matmuls {100 * matmul / total:.0f}% of profiled op time; {calls:.0f} aten calls/step"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
