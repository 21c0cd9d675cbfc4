"""kvmesh's in-process engine against transformers `generate`, same model, same run.

Throughput: N prompts of random length through kvmesh (continuous batching, all submitted at
once) and through transformers at each batch size tried (prompts sorted by length first, which
helps it: less padding); its best batch size is the peer. Batch-1 decode: tokens per second after
the first token, one request alone. Run: make bench-engine
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, SchedulerConfig, parse_bytes
from shared.sampling import SamplingParams


def make_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids above the special tokens; random text is as costly to compute as real text.
    return [
        [rng.randrange(100, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


def bench_kvmesh(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + sum(map(len, prompts))) / elapsed,
    }


def kvmesh_decode_rate(engine: Engine, prompt: list[int], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    first = None
    while engine.has_unfinished():
        engine.step()
        first = first or time.perf_counter()
    return (output_len - 1) / (time.perf_counter() - first)


def load_hf(model_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype
    )
    model.generation_config.eos_token_id = None  # fixed-length outputs, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_generate(model, prompts: list[list[int]], output_len: int) -> int:
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False
        )
    return (out.shape[1] - longest) * len(prompts)


def bench_hf(model, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    ordered = sorted(prompts, key=len)
    started = time.perf_counter()
    generated = sum(
        hf_generate(model, ordered[i : i + batch_size], output_len)
        for i in range(0, len(ordered), batch_size)
    )
    elapsed = time.perf_counter() - started
    return {
        "batch_size": batch_size,
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + sum(map(len, prompts))) / elapsed,
    }


def hf_decode_rate(model, prompt: list[int], output_len: int) -> float:
    started = time.perf_counter()
    hf_generate(model, [prompt], 1)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    hf_generate(model, [prompt], output_len)
    return (output_len - 1) / (time.perf_counter() - started - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", default="8,16,32,64")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-memory", default="3GiB", help="room for every prompt at once")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kv_budget = parse_bytes(args.kv_memory)
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            num_threads=args.threads,
            cache=CacheConfig(kv_memory_bytes=kv_budget),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048),
        )
    )
    vocab = engine.worker.architecture.vocab_size
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    single = make_prompts(1, 128, 128, vocab, args.seed + 1)[0]
    print(
        f"workload: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens "
        f"({sum(map(len, prompts))} in all), {args.output_len} output tokens each, "
        f"dtype {args.dtype}, {args.threads} threads"
    )
    kvmesh_decode_rate(engine, single, 8)  # warm both paths before timing
    results: dict = {"kvmesh": bench_kvmesh(engine, prompts, args.output_len)}
    print(
        f"kvmesh        {results['kvmesh']['seconds']:7.1f}s  "
        f"{results['kvmesh']['output_tok_s']:7.1f} output tok/s"
    )
    results["kvmesh_batch1_decode_tok_s"] = kvmesh_decode_rate(engine, single, args.output_len)
    model = load_hf(engine.worker.model_path, getattr(torch, args.dtype))
    hf_generate(model, [single], 2)
    results["transformers"] = []
    for batch_size in (int(b) for b in args.hf_batch_sizes.split(",")):
        run = bench_hf(model, prompts, args.output_len, batch_size)
        results["transformers"].append(run)
        print(
            f"transformers  {run['seconds']:7.1f}s  {run['output_tok_s']:7.1f} output tok/s  "
            f"(batch {batch_size})"
        )
    results["transformers_batch1_decode_tok_s"] = hf_decode_rate(model, single, args.output_len)
    best = max(results["transformers"], key=lambda r: r["output_tok_s"])
    ratio = results["kvmesh"]["output_tok_s"] / best["output_tok_s"]
    decode_ratio = (
        results["kvmesh_batch1_decode_tok_s"] / results["transformers_batch1_decode_tok_s"]
    )
    results.update(throughput_ratio=ratio, batch1_decode_ratio=decode_ratio)
    print(
        f"\nthroughput: kvmesh {results['kvmesh']['output_tok_s']:.1f} vs transformers "
        f"{best['output_tok_s']:.1f} output tok/s (best batch {best['batch_size']}): {ratio:.2f}x"
    )
    print(
        f"batch-1 decode: kvmesh {results['kvmesh_batch1_decode_tok_s']:.1f} vs transformers "
        f"{results['transformers_batch1_decode_tok_s']:.1f} tok/s: {decode_ratio:.2f}x"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
