"""Decode tokens/s on one NVIDIA GPU, in one run: the cupy backend, the torch backend on the
same GPU (KVMESH_TORCH_DEVICE=cuda), and transformers `generate`, at batch 1, 32 and 128.

Each side decodes `--output-len` tokens after 128-token random prompts (ignore_eos, greedy).
kvmesh sides: every prompt is prefilled in the first step, then the decode window is timed
step by step (tokens produced after the first token of every request / its wall time).
transformers: (time of generate(N) - time of generate(1)) for batch x (N - 1) tokens. Also
printed: the batch-1 bandwidth limit (weight bytes / peak bandwidth) and the ratios.
Goals: batch 1 within 2x of the limit; >= 3x transformers at batch 32. Run: make bench-gpu
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from kvmesh.engine import Engine
from loadtest.kernel_bench import device_name, peak_bandwidth_gb_s
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.model_paths import default_model_path
from shared.sampling import SamplingParams

BATCHES = (1, 32, 128)
PROMPT_LEN = 128


def prompts(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def kvmesh_decode_tok_s(backend: str, dtype: str, batch: int, output_len: int) -> tuple[float, int]:
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
    num_parameters = engine.worker.manifest.num_parameters
    del engine
    return window_tokens / elapsed, num_parameters


def transformers_decode_tok_s(dtype: str, batch: int, output_len: int) -> float:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = (
        AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
        )
        .to("cuda")
        .eval()
    )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    peak = peak_bandwidth_gb_s()
    print(
        f"{device_name()}, peak {peak:.0f} GB/s; default model, {args.dtype}, "
        f"prompts {PROMPT_LEN} tokens, {args.output_len} decoded"
    )
    rows = []
    for batch in BATCHES:
        cupy_tok_s, num_parameters = kvmesh_decode_tok_s("cupy", args.dtype, batch, args.output_len)
        torch_tok_s, _ = kvmesh_decode_tok_s("torch", args.dtype, batch, args.output_len)
        hf_tok_s = transformers_decode_tok_s(args.dtype, batch, args.output_len)
        rows.append((batch, cupy_tok_s, torch_tok_s, hf_tok_s))
        print(
            f"batch {batch:>4}: cupy {cupy_tok_s:>9.0f} tok/s | torch backend {torch_tok_s:>9.0f} "
            f"| transformers {hf_tok_s:>9.0f} | cupy/transformers {cupy_tok_s / hf_tok_s:.2f}x",
            flush=True,
        )
    weight_bytes = num_parameters * 2
    limit = peak * 1e9 / weight_bytes
    batch1 = rows[0][1]
    print(
        f"batch-1 bandwidth limit: {weight_bytes / 1e6:.0f} MB of weights per token -> "
        f"{limit:.0f} tok/s; cupy at batch 1: {batch1:.0f} tok/s = {limit / batch1:.2f}x the "
        f"limit's time per token (goal <= 2x)"
    )


if __name__ == "__main__":
    main()
