"""K-quant GGUFs of the default model against llama.cpp on the same files, same run
(`make bench-kquants`; a few minutes after llama.cpp's one-time build).

The default model's weights as an F32 GGUF (`kvmesh convert`), quantized by llama.cpp's own
`llama-quantize` into Q4_K_M, Q5_K_M and Q6_K, then for each file:
- perplexity as `llama-perplexity` computes it (chunks of `--context` tokens, BOS first where
  the vocabulary adds one, the second half of each chunk scored), by kvmesh (the packed CPU
  weights it runs the file with) and by llama-perplexity itself, on two texts: the shipped one
  (~760 scored tokens) and the project's docs (`--chunks` chunks of them, ~12.7k scored tokens
  at the default 100, where one realization of either side's rounding moves the figure ~6x less);
  the F32 file first, float32 on both sides, as the check that the two compute the same figure;
- kvmesh's resident weight bytes against the file's size.
And decode tok/s on the Q4_K_M file against `llama-batched-bench` (llama.cpp's defaults: its
CPU repacking on, off where its repacked kernels die) at batch 1/8/32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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
DOCS = Path(__file__).parent.parent / "docs"


def docs_text(out: Path) -> Path:
    """The docs' pages in path order as one file: the long text both sides read."""
    path = out / "docs.txt"
    pages = sorted(DOCS.rglob("*.md"))
    path.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in pages), encoding="utf-8")
    return path


def chunked_perplexity(
    worker: Worker, token_ids: list[int], context: int, bos: int | None, chunks: int | None = None
) -> float:
    """llama-perplexity's figure: each whole chunk of `context` tokens (its first replaced by
    `bos`, where the vocabulary adds one) predicts its second half from its first; the first
    `chunks` chunks only where given, as its `--chunks`."""
    first = context // 2
    nll, count = 0.0, 0
    whole = (len(token_ids) // context) * context
    if chunks is not None:
        whole = min(whole, chunks * context)
    for start in range(0, whole, context):
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


def text_perplexities(
    path: str,
    weights: str,
    args: argparse.Namespace,
    texts: dict[str, tuple[list[int], int | None]],
    bos: int | None,
) -> tuple[dict[str, float], int]:
    """kvmesh's figure on each text (its token ids and chunk limit) and its resident weights."""
    worker = _worker(path, weights, args.threads)
    found = {
        name: chunked_perplexity(worker, ids, args.context, bos, chunks)
        for name, (ids, chunks) in texts.items()
    }
    return found, worker.runner.weights_resident_bytes


def llama_perplexity(
    bin_dir: Path, model: str, text: Path, context: int, threads: int, chunks: int | None
) -> float:
    limit = ["--chunks", str(chunks)] if chunks is not None else []
    result = llama_cpp.run_repacked(
        [
            str(bin_dir / "llama-perplexity"),
            *limit,
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
        ]
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{result.stderr[-2000:]}")
    return float(found.group(1))


def perplexity_verdict(perplexity: dict[str, dict[str, dict[str, float]]]) -> str:
    """The goal, judged on the long text: kvmesh within 0.5% of llama-perplexity, each file."""
    parts = []
    for kind, texts in perplexity.items():
        gap = texts["docs"]["kvmesh"] / texts["docs"]["llama.cpp"] - 1
        parts.append(f"{kind} {gap:+.2%} {'yes' if abs(gap) <= 0.005 else 'NO'}")
    return "kvmesh within 0.5% of llama-perplexity on the docs text: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kinds", type=lambda t: [k for k in t.split(",") if k], default=list(KINDS)
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=100, help="of the docs text")
    parser.add_argument(
        "--batches",
        type=lambda t: [int(x) for x in t.split(",") if x],
        default=[1, 8, 32],
        help="decode batch sizes; empty for perplexity and memory only",
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
    texts = {"shipped": (SHIPPED_TEXT, None), "docs": (docs_text(args.out), args.chunks)}
    results: dict = {"perplexity": {}, "resident": {}, "decode": {}}
    # F32 first: both sides unrounded, the check that the two compute the same figure.
    for kind in ("F32", *args.kinds):
        path = str(args.out / f"smollm2-{kind}.gguf") if kind != "F32" else f32_path
        if not os.path.exists(path):
            llama_cpp.quantize(bin_dir, f32_path, path, kind)
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise SystemExit(f"{path} has no tokenizer")
        bos = tokenizer.tokenizer.token_to_id(tokenizer.bos_token) if tokenizer.add_bos else None
        chunked = {
            name: (tokenizer.encode(file.read_text(encoding="utf-8")), chunks)
            for name, (file, chunks) in texts.items()
        }
        weights = "float32" if kind == "F32" else "auto"
        ours, resident = text_perplexities(path, weights, args, chunked, bos)
        # The file's own values, unrounded activations: what its quantization alone costs.
        exact = ours if kind == "F32" else text_perplexities(path, "float32", args, chunked, bos)[0]
        size = os.path.getsize(path)
        results["perplexity"][kind] = {}
        for name, (file, chunks) in texts.items():
            theirs = llama_perplexity(bin_dir, path, file, args.context, args.threads, chunks)
            results["perplexity"][kind][name] = {
                "kvmesh": ours[name],
                "kvmesh_float32": exact[name],
                "llama.cpp": theirs,
            }
            print(
                f"{kind:7s} {name:7s} perplexity kvmesh {ours[name]:.4f}  llama.cpp "
                f"{theirs:.4f} ({ours[name] / theirs - 1:+.2%}); kvmesh on the file's values in "
                f"float32 {exact[name]:.4f} ({exact[name] / theirs - 1:+.2%})",
                flush=True,
            )
        results["resident"][kind] = {"kvmesh_bytes": resident, "file_bytes": size}
        print(
            f"{kind:7s} weights resident {resident / 2**20:.1f} MiB, file {size / 2**20:.1f} MiB",
            flush=True,
        )
    print(perplexity_verdict(results["perplexity"]), flush=True)
    if not args.batches:
        (args.out / "kquants.json").write_text(json.dumps(results, indent=2))
        return
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
