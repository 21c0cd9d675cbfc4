"""n = 8 completions of one prompt as one request (its completions fork from one computed
prompt) against the same 8 as separate requests, with the prefix cache on (they may hit what
another one computed) and off (each computes the whole prompt), on the in-process engine with
the default model, one run.

Reported per way: wall seconds, output tokens per second, prompt tokens computed (from the
block manager: what was neither forked nor a cache hit) and the most KV blocks held at once.
Run: make bench-n
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, parse_bytes
from shared.model_paths import default_model_path
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class Outcome:
    seconds: float
    output_tokens: int
    prompt_tokens_computed: int
    peak_blocks: int


def run(engine: Engine, prompt: list[int], args: argparse.Namespace, grouped: bool) -> Outcome:
    manager = engine.scheduler.block_manager
    forked, hits = manager.stats.forked, manager.stats.hits
    params = SamplingParams(
        max_tokens=args.output_len, temperature=1.0, seed=args.seed, ignore_eos=True
    )
    started = time.perf_counter()
    for index in range(args.n):
        engine.add_request(
            prompt,
            dataclasses.replace(params, seed=args.seed + index),
            request_id=f"{'group' if grouped else 'single'}-{index}",
            group_id="group" if grouped else "",
        )
    output_tokens = peak = 0
    while engine.has_unfinished():
        output_tokens += sum(len(o.new_token_ids) for o in engine.step())
        peak = max(peak, manager.num_blocks - manager.num_free_blocks)
    seconds = time.perf_counter() - started
    skipped = (manager.stats.forked - forked) + (manager.stats.hits - hits)
    return Outcome(seconds, output_tokens, args.n * len(prompt) - skipped, peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--kv-memory", default="512MiB")
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(args.prompt_len)]

    def engine(prefix_caching: bool) -> Engine:
        cache = CacheConfig(
            kv_memory_bytes=parse_bytes(args.kv_memory), enable_prefix_caching=prefix_caching
        )
        return Engine(EngineConfig(model=default_model_path(), cache=cache))

    cached, uncached = engine(True), engine(False)
    for warm in (cached, uncached):  # first steps of a fresh engine are slower
        warm.generate([prompt[:64]], SamplingParams(max_tokens=4))
    rows = [
        ("n = 8 as one request (forks)", run(uncached, prompt, args, grouped=True)),
        ("8 requests, prefix cache on", run(cached, prompt, args, grouped=False)),
        ("8 requests, prefix cache off", run(uncached, prompt, args, grouped=False)),
    ]
    base = rows[0][1]
    print(
        f"default model, {args.n} completions of a {args.prompt_len}-token prompt, "
        f"{args.output_len} tokens each, temperature 1.0"
    )
    print("| way | seconds | out tok/s | prompt tokens computed | peak KV blocks | vs n = 8 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, outcome in rows:
        rate = outcome.output_tokens / outcome.seconds
        print(
            f"| {name} | {outcome.seconds:.2f} | {rate:.1f} | {outcome.prompt_tokens_computed} "
            f"| {outcome.peak_blocks} | {base.seconds / outcome.seconds:.2f}x |"
        )


if __name__ == "__main__":
    main()
