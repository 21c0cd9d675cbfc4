"""Perplexity of a text under each weight format, and how far each is from float32, same run.

The packed (int8) weights and int8 activations round what the float32 path computes; this is
the check that they keep the model's quality: packed within 1% of float32's perplexity (the
tests assert it on the shipped text). Perplexity alone is a noisy judge of a rounding scheme
(one realization of the rounding over ~1,800 tokens: ±0.5% on this text), so each format's mean
KL divergence from float32 per token and its top-1 agreement with float32 are printed too.
Run: python -m loadtest.perplexity [--model PATH] [--text FILE] [--formats float32,packed]
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


def perplexity(log_softmax: torch.Tensor, token_ids: list[int]) -> float:
    """log_softmax: (len - 1, vocab) next-token distributions after each prefix of token_ids."""
    targets = torch.tensor(token_ids[1:])[:, None]
    return math.exp(-float(log_softmax.gather(1, targets).double().mean()))


def kl_from(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL(reference || other) per position, in nats."""
    reference, other = reference.double(), other.double()
    return float((reference.exp() * (reference - other)).sum(-1).mean())


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
    distributions = {}
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
        distributions[fmt] = worker.prompt_log_softmax(ids)
        print(f"{fmt:9s} {len(ids)} tokens  perplexity {perplexity(distributions[fmt], ids):.4f}")
    reference = distributions.get("float32")
    if reference is None:
        return
    base = perplexity(reference, ids)
    for fmt, found in distributions.items():
        if fmt != "float32":
            agree = float((found.argmax(-1) == reference.argmax(-1)).double().mean())
            print(
                f"{fmt} / float32: perplexity {perplexity(found, ids) / base:.4f}x, "
                f"KL {kl_from(reference, found):.5f} nats/token, top-1 agreement {agree:.4f}"
            )


if __name__ == "__main__":
    main()
