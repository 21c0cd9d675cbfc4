"""Decode tokens/s on one NVIDIA GPU, in one run: the cupy backend, the torch backend on the
same GPU (KVMESH_TORCH_DEVICE=cuda), transformers `generate`, and llama.cpp's CUDA build
(`llama-batched-bench -ngl 99`) on the same weights as F16 and as the shipped Q4_1, at batch 1,
32 and 128.

Each side decodes `--output-len` tokens after 128-token random prompts (ignore_eos, greedy).
kvmesh sides: every prompt is prefilled in the first step, then the decode window is timed
step by step (tokens produced after the first token of every request / its wall time).
transformers: (time of generate(N) - time of generate(1)) for batch x (N - 1) tokens.
llama.cpp: its own decode tok/s for the same prompt and output lengths; the F16 file is written
from the Q4_1 one (F32 through `kvmesh convert`, then llama-quantize). Also printed: the batch-1
bandwidth limit (weight bytes / peak bandwidth) and the ratios; --json writes every figure.
Run: make bench-gpu
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from kvmesh.convert import gguf_to_f32
from kvmesh.engine import Engine
from loadtest import llama_cpp
from loadtest.kernel_bench import device_name, peak_bandwidth_gb_s
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.model_paths import default_model_path
from shared.sampling import SamplingParams

BATCHES = (1, 32, 128)
PROMPT_LEN = 128


def prompts(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def kvmesh_decode_tok_s(
    backend: str, dtype: str, batch: int, output_len: int
) -> tuple[float, Engine]:
    os.environ["KVMESH_TORCH_DEVICE"] = "cuda" if backend == "torch" else "cpu"
    engine = Engine(
        EngineConfig(
            backend=backend,
            dtype=dtype,
            cache=CacheConfig(kv_memory_bytes=4 << 30),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=batch * PROMPT_LEN, max_num_seqs=batch
            ),
        )
    )
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate(prompts(batch, 1), warm)  # loads kernels, captures this batch's graph
    for prompt in prompts(batch, 0):
        engine.add_request(prompt, params)
    started: set[str] = set()
    window_start, window_tokens = 0.0, 0
    while engine.has_unfinished():
        outputs = engine.step()
        if len(started) == batch:
            window_tokens += sum(len(o.new_token_ids) for o in outputs)
        for output in outputs:
            started.add(output.request_id)
        if len(started) == batch and not window_start:
            torch.cuda.synchronize()
            window_start = time.perf_counter()
    elapsed = time.perf_counter() - window_start
    return window_tokens / elapsed, engine


@functools.cache
def _transformers_model(dtype: str):  # type: ignore[no-untyped-def]
    """Loaded once for every batch size (dequantizing the GGUF takes a while)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return (
        AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
        )
        .to("cuda")
        .eval()
    )


def transformers_decode_tok_s(dtype: str, batch: int, output_len: int) -> float:
    model = _transformers_model(dtype)
    ids = torch.tensor(prompts(batch, 0), device="cuda")

    def timed(new_tokens: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - started

    timed(4)
    full, prefill = timed(output_len), timed(1)
    return batch * (output_len - 1) / (full - prefill)


def llama_cpp_decode_tok_s(args: argparse.Namespace, output_len: int) -> dict[str, dict]:
    """{"F16": {batch: tok/s}, "Q4_1": {...}} from llama.cpp's CUDA build."""
    bin_dir = Path(args.llama_bin) if args.llama_bin else llama_cpp.build(cuda_arch=args.cuda_arch)
    q4 = args.q4_model or default_model_path()
    f16 = args.f16_model
    scratch = tempfile.TemporaryDirectory()
    if f16 is None:
        f32 = os.path.join(scratch.name, "model.F32.gguf")
        gguf_to_f32(q4, f32)
        f16 = llama_cpp.quantize(bin_dir, f32, os.path.join(scratch.name, "model.F16.gguf"), "F16")
    figures = {}
    for kind, path in (("F16", f16), ("Q4_1", q4)):
        rows = llama_cpp.batched_bench(
            bin_dir, path, list(BATCHES), PROMPT_LEN, output_len, os.cpu_count() or 1, 99
        )
        figures[kind] = {row.batch: row.decode_tok_s for row in rows}
    scratch.cleanup()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--llama-bin", help="llama.cpp CUDA binaries (default: build them)")
    parser.add_argument("--cuda-arch", default="90", help="for the llama.cpp build")
    parser.add_argument("--q4-model", help="llama.cpp's Q4_1 file (default: the default model)")
    parser.add_argument("--f16-model", help="an F16 GGUF of the same weights (default: written)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    peak = peak_bandwidth_gb_s()
    print(
        f"{device_name()}, peak {peak:.0f} GB/s; default model, {args.dtype}, "
        f"prompts {PROMPT_LEN} tokens, {args.output_len} decoded"
    )
    llama = {} if args.no_llama_cpp else llama_cpp_decode_tok_s(args, args.output_len)
    rows: list[dict] = []
    graphs: dict[str, str] | None = None
    num_parameters = 0
    for batch in BATCHES:
        cupy_tok_s, engine = kvmesh_decode_tok_s("cupy", args.dtype, batch, args.output_len)
        num_parameters, graphs = (
            engine.worker.manifest.num_parameters,
            engine.worker.manifest.cuda_graphs,
        )
        del engine
        torch_tok_s, engine = kvmesh_decode_tok_s("torch", args.dtype, batch, args.output_len)
        del engine
        row = {
            "batch": batch,
            "kvmesh_cupy": cupy_tok_s,
            "kvmesh_torch": torch_tok_s,
            "transformers": transformers_decode_tok_s(args.dtype, batch, args.output_len),
            **{f"llama_cpp_{kind}": figures.get(batch) for kind, figures in llama.items()},
        }
        rows.append(row)
        peers = " | ".join(
            f"{name} {value:>8.0f}" for name, value in row.items() if name != "batch" and value
        )
        ratios = " ".join(
            f"cupy/{name} {cupy_tok_s / float(value):.2f}x"
            for name, value in row.items()
            if name not in ("batch", "kvmesh_cupy") and value
        )
        print(f"batch {batch:>4}: {peers} tok/s | {ratios}", flush=True)
    weight_bytes = num_parameters * 2
    limit = peak * 1e9 / weight_bytes
    batch1 = rows[0]["kvmesh_cupy"]
    print(
        f"batch-1 bandwidth limit: {weight_bytes / 1e6:.0f} MB of weights per token -> "
        f"{limit:.0f} tok/s; cupy at batch 1: {batch1:.0f} tok/s = {limit / batch1:.2f}x the "
        "limit's time per token"
    )
    if args.json:
        summary = {
            "device": device_name(),
            "peak_gb_s": peak,
            "dtype": args.dtype,
            "prompt_len": PROMPT_LEN,
            "output_len": args.output_len,
            "cuda_graphs": graphs,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
