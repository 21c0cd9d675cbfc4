"""What a response format costs per output token: the same batch decoded free and constrained,
in one process and one run, rounds alternating.

N requests (random-token prompts, temperature 1.0, fixed seeds, ignore_eos) decode `--output-len`
tokens each, once free and once under a regex that cannot finish within them (letters and
spaces, at least 4x as many characters as tokens), so both batches keep the same shape for
every step. TPOT = time from a request's first token to its last / (tokens - 1), median over
requests; the best round of each side counts. Run: make bench-structured
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvmesh.engine import Engine
from loadtest.engine_bench import make_prompts
from shared.config import CacheConfig, EngineConfig
from shared.sampling import ResponseFormat, SamplingParams


def median_tpot_ms(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids:
                now = time.perf_counter()
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
                count[output.request_id] = count.get(output.request_id, 0) + 1
    return statistics.median(
        (last[i] - first[i]) / (count[i] - 1) * 1e3 for i in ids if count[i] > 1
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engine = Engine(EngineConfig(cache=CacheConfig(kv_memory_bytes=512 << 20)))
    prompts = make_prompts(args.requests, args.prompt_len, args.prompt_len, 49152, seed=0)
    regex = ResponseFormat("regex", f"[a-z ]{{{4 * args.output_len},}}")
    free = [
        SamplingParams(max_tokens=args.output_len, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(args.requests)
    ]
    constrained = [SamplingParams(**{**vars(p), "response_format": regex}) for p in free]
    median_tpot_ms(engine, prompts[:2], free[:2])  # warm-up
    median_tpot_ms(engine, prompts[:2], constrained[:2])  # and the format's compile
    results: dict[str, list[float]] = {"free": [], "constrained": []}
    for round_index in range(args.rounds):
        order = ("free", "constrained") if round_index % 2 == 0 else ("constrained", "free")
        for side in order:
            params = free if side == "free" else constrained
            results[side].append(median_tpot_ms(engine, prompts, params))
            print(
                f"round {round_index} {side:<11}: TPOT p50 {results[side][-1]:.2f} ms", flush=True
            )
    best_free, best_constrained = min(results["free"]), min(results["constrained"])
    print(
        f"\n{args.requests} requests in one batch, {args.output_len} output tokens each, "
        f"{args.threads} threads"
    )
    print(f"free:        TPOT p50 {best_free:.2f} ms (best round)")
    print(f"constrained: TPOT p50 {best_constrained:.2f} ms (best round)")
    cost = (best_constrained / best_free - 1) * 100
    print(f"cost of the response format: {cost:+.1f}% (goal < 10%)")


if __name__ == "__main__":
    main()
