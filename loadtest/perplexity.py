"""Perplexity of a text under each weight format, same model, same run.

The packed (int8) weights and int8 activations round what the float32 path computes; this is
the check that they keep the model's quality: packed within 1% of float32 (the tests assert it
on the shipped text). Run: python -m loadtest.perplexity [--model PATH] [--text FILE]
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from services.engine_worker.worker import Worker
from shared.config import CacheConfig, EngineConfig
from shared.text_tokenizer import load_tokenizer

SHIPPED_TEXT = Path(__file__).parent / "texts" / "lighthouse.txt"


def perplexity(worker: Worker, token_ids: list[int]) -> float:
    return math.exp(-float(worker.prompt_logprobs(token_ids).double().mean()))


def text_token_ids(model_path: str, text: str) -> list[int]:
    tokenizer = load_tokenizer(model_path)
    if tokenizer is None:
        raise SystemExit(f"{model_path} has no tokenizer")
    return tokenizer.encode(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--text", type=Path, default=SHIPPED_TEXT)
    parser.add_argument("--formats", default="float32,packed")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for fmt in args.formats.split(","):
        worker = Worker(
            EngineConfig(
                model=args.model,
                weights=fmt,
                num_threads=args.threads,
                cache=CacheConfig(kv_memory_bytes=256 << 20),
            )
        )
        ids = text_token_ids(worker.model_path, args.text.read_text(encoding="utf-8"))
        results[fmt] = perplexity(worker, ids)
        print(f"{fmt:9s} {len(ids)} tokens  perplexity {results[fmt]:.4f}", flush=True)
    if "float32" in results:
        for fmt, value in results.items():
            print(f"{fmt} / float32: {value / results['float32']:.4f}")


if __name__ == "__main__":
    main()
