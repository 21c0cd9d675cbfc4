"""Speculative decoding's benchmark: tokens/s and TPOT with speculation off, ngram and suffix,
at concurrency 1 and 8, on a copy-heavy workload (workloads/text/copy_edit.toml), open-ended chat
questions (workloads/text/open_chat.toml) and sharegpt (random-token prompts, on which the small
model's greedy answers fall into loops: drafts thrive there), in process on the default model,
one run. Ratios are against `off` in the same run.

Run: python -m loadtest.spec_bench [--requests 8] [--concurrency 1 8] [--methods off ngram suffix]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import tomllib
import torch

from kvmesh.engine import Engine
from loadtest.workload import Workload
from shared.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from shared.sampling import SamplingParams

HERE = Path(__file__).parent


def copy_prompts(engine: Engine, count: int) -> tuple[list[list[int]], int]:
    spec = tomllib.loads((HERE / "workloads" / "text" / "copy_edit.toml").read_text())
    text = (HERE / "texts" / spec["text"]).read_text()
    size, tasks = spec["passage_chars"], spec["tasks"]
    assert engine.tokenizer is not None
    prompts = []
    for index in range(count):
        start = (index * size // 2) % max(1, len(text) - size)
        passage = text[start : start + size]
        message = f"{tasks[index % len(tasks)]}\n\n{passage}"
        prompts.append(engine.tokenizer.encode_chat([{"role": "user", "content": message}]))
    return prompts, spec["max_tokens"]


def chat_prompts(engine: Engine, count: int) -> tuple[list[list[int]], int]:
    spec = tomllib.loads((HERE / "workloads" / "text" / "open_chat.toml").read_text())
    assert engine.tokenizer is not None
    questions = [spec["prompts"][i % len(spec["prompts"])] for i in range(count)]
    chats = [[{"role": "user", "content": question}] for question in questions]
    return [engine.tokenizer.encode_chat(chat) for chat in chats], spec["max_tokens"]


def workload(engine: Engine, name: str, count: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and their max_tokens."""
    if name == "sharegpt":
        chat = Workload.load("sharegpt").build(engine.worker.architecture.vocab_size, count)
        return [r.prompt for r in chat], [r.max_tokens for r in chat]
    prompts, max_tokens = (copy_prompts if name == "copy_edit" else chat_prompts)(engine, count)
    return prompts, [max_tokens] * len(prompts)


def run(engine: Engine, prompts: list[list[int]], outputs: list[int], concurrency: int) -> dict:
    """Keeps `concurrency` requests in flight: output tok/s over the whole run (prefills
    included), and the mean TPOT (first token to last, per later token)."""
    pending = list(zip(prompts, outputs, strict=True))
    first_at: dict[str, float] = {}
    produced: dict[str, int] = {}
    tpots: list[float] = []
    began = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(produced) - len(tpots) < concurrency:  # started less finished
            prompt, max_tokens = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            produced[engine.add_request(prompt, params)] = 0
        for output in engine.step():
            now = time.perf_counter()
            rid = output.request_id
            first_at.setdefault(rid, now)  # a prefill's one token comes first, alone
            produced[rid] += len(output.new_token_ids)
            if output.finished:
                tokens = produced[rid] - 1
                tpots.append((now - first_at[rid]) / tokens if tokens > 0 else 0.0)
    elapsed = time.perf_counter() - began
    total = sum(produced.values())
    return {"tok_s": total / elapsed, "tpot_ms": 1e3 * sum(tpots) / len(tpots), "tokens": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--methods", nargs="+", default=["off", "ngram", "suffix"])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for method in args.methods:
        for name in ("copy_edit", "open_chat", "sharegpt"):
            for concurrency in args.concurrency:
                # A fresh engine per point: the suffix proposer's shared trie would otherwise
                # have learned the answers from the point before (same prompts, greedy).
                engine = Engine(
                    EngineConfig(
                        num_threads=args.threads,
                        cache=CacheConfig(kv_memory_bytes=512 << 20, enable_prefix_caching=False),
                        scheduler=SchedulerConfig(speculative=SpeculativeConfig(method)),
                    )
                )
                prompts, outputs = workload(engine, name, args.requests)
                result = run(engine, prompts, outputs, concurrency)
                speculator = engine.scheduler.speculator
                rows.append((name, concurrency, method, result))
                print(
                    f"{name:9s} c={concurrency:<2d} {method:6s} {result['tok_s']:7.1f} tok/s "
                    f"TPOT {result['tpot_ms']:6.1f} ms ({result['tokens']} tokens; drafts "
                    f"accepted {speculator.num_accepted_drafts}/{speculator.num_draft_tokens})",
                    flush=True,
                )
    print("\nagainst off, same run: output tok/s (prefills included), and TPOT (decode speed)")
    base = {(n, c): r for n, c, m, r in rows if m == "off"}
    for name, concurrency, method, result in rows:
        off = base.get((name, concurrency))
        if method != "off" and off is not None:
            print(
                f"{name:9s} c={concurrency:<2d} {method:6s} {result['tok_s'] / off['tok_s']:5.2f}x "
                f"tok/s, {off['tpot_ms'] / result['tpot_ms']:5.2f}x decode (1 / TPOT)"
            )


if __name__ == "__main__":
    main()
