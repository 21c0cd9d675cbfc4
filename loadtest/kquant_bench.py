"""K-quant GGUFs of the default model against llama.cpp on the same files, same run
(`make bench-kquants`; a few minutes after llama.cpp's one-time build).

The default model's weights as an F32 GGUF (`kvmesh convert`), quantized by llama.cpp's own
`llama-quantize` into Q4_K_M, Q5_K_M and Q6_K, then for each file:
- perplexity on the shipped text as `llama-perplexity` computes it (chunks of `--context`
  tokens, BOS first where the vocabulary adds one, the second half of each chunk scored), by
  kvmesh (the packed CPU weights it runs the file with) and by llama-perplexity itself; the F32
  file first, float32 on both sides, as the check that the two compute the same figure;
- kvmesh's resident weight bytes against the file's size.
And decode tok/s on the Q4_K_M file against `llama-batched-bench` (llama.cpp's defaults: its
CPU repacking on) at batch 1/8/32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
from pathlib import Path

import torch

from kvmesh.convert import gguf_to_f32
from loadtest import llama_cpp
from loadtest.cpu_bench import decode_engine, kvmesh_decode_tok_s
from loadtest.perplexity import SHIPPED_TEXT
from services.engine_worker.worker import Worker
from shared.config import CacheConfig, EngineConfig
from shared.model_paths import default_model_path
from shared.text_tokenizer import load_tokenizer

KINDS = ("Q4_K_M", "Q5_K_M", "Q6_K")


def chunked_perplexity(
    worker: Worker, token_ids: list[int], context: int, bos: int | None
) -> float:
    """llama-perplexity's figure: each whole chunk of `context` tokens (its first replaced by
    `bos`, where the vocabulary adds one) predicts its second half from its first."""
    first = context // 2
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - context + 1, context):
        chunk = token_ids[start : start + context]
        if bos is not None:
            chunk[0] = bos
        log_softmax = worker.prompt_log_softmax(chunk)  # row j predicts chunk[j + 1]
        targets = torch.tensor(chunk[first + 1 :])[:, None]
        nll -= float(log_softmax[first:].gather(1, targets).double().sum())
        count += len(chunk) - first - 1
    return math.exp(nll / count)


def _worker(path: str, weights: str, threads: int) -> Worker:
    return Worker(
        EngineConfig(
            model=path,
            weights=weights,
            num_threads=threads,
            cache=CacheConfig(kv_memory_bytes=64 << 20),
        )
    )


def llama_perplexity(bin_dir: Path, model: str, text: Path, context: int, threads: int) -> float:
    result = subprocess.run(
        [
            str(bin_dir / "llama-perplexity"),
            "-m",
            model,
            "-f",
            str(text),
            "-c",
            str(context),
            "-b",
            str(context),
            "-t",
            str(threads),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{result.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kinds", type=lambda t: t.split(","), default=list(KINDS))
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument(
        "--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 32]
    )
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--generated", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path, default=Path("results/kquants"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    bin_dir = llama_cpp.build()
    f32_path = str(args.out / "smollm2-f32.gguf")
    if not os.path.exists(f32_path):
        gguf_to_f32(default_model_path(), f32_path)
    text = SHIPPED_TEXT.read_text(encoding="utf-8")
    results: dict = {"perplexity": {}, "resident": {}, "decode": {}}
    # F32 first: both sides unrounded, the check that the two compute the same figure.
    for kind in ("F32", *args.kinds):
        path = str(args.out / f"smollm2-{kind}.gguf") if kind != "F32" else f32_path
        if not os.path.exists(path):
            llama_cpp.quantize(bin_dir, f32_path, path, kind)
        worker = _worker(path, "float32" if kind == "F32" else "auto", args.threads)
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise SystemExit(f"{path} has no tokenizer")
        ids = tokenizer.encode(text)
        bos = tokenizer.tokenizer.token_to_id(tokenizer.bos_token) if tokenizer.add_bos else None
        ours = chunked_perplexity(worker, ids, args.context, bos)
        theirs = llama_perplexity(bin_dir, path, SHIPPED_TEXT, args.context, args.threads)
        resident, size = worker.runner.weights_resident_bytes, os.path.getsize(path)
        del worker
        # The file's own values, unrounded activations: what its quantization alone costs.
        exact = ours
        if kind != "F32":
            exact = chunked_perplexity(
                _worker(path, "float32", args.threads), ids, args.context, bos
            )
        results["perplexity"][kind] = {"kvmesh": ours, "kvmesh_float32": exact, "llama.cpp": theirs}
        results["resident"][kind] = {"kvmesh_bytes": resident, "file_bytes": size}
        print(
            f"{kind:7s} perplexity kvmesh {ours:.4f}  llama.cpp {theirs:.4f}  "
            f"({ours / theirs - 1:+.2%}); kvmesh on the file's values in float32 {exact:.4f} "
            f"({exact / theirs - 1:+.2%}); weights resident {resident / 2**20:.1f} MiB, "
            f"file {size / 2**20:.1f} MiB",
            flush=True,
        )
    q4 = str(args.out / "smollm2-Q4_K_M.gguf")
    engine = decode_engine(q4, "auto", args.threads)
    ours_rates = {
        b: kvmesh_decode_tok_s(engine, b, args.prompt, args.generated) for b in args.batches
    }
    del engine
    rows = llama_cpp.batched_bench(
        bin_dir, q4, args.batches, args.prompt, args.generated, args.threads, repack=True
    )
    for row in rows:
        ours = ours_rates[row.batch]
        results["decode"][row.batch] = {"kvmesh": ours, "llama.cpp": row.decode_tok_s}
        print(
            f"Q4_K_M decode batch {row.batch:3d}: kvmesh {ours:7.1f} tok/s, llama.cpp "
            f"{row.decode_tok_s:7.1f} tok/s ({ours / row.decode_tok_s:.2f}x)",
            flush=True,
        )
    (args.out / "kquants.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
