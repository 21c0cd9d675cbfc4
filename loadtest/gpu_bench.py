"""Decode tokens/s on one NVIDIA GPU, in one run: the cupy backend, the torch backend on the
same GPU (KVMESH_TORCH_DEVICE=cuda), transformers `generate`, and llama.cpp's CUDA build
(`llama-batched-bench -ngl 99`) on the same weights as F16 and as the shipped Q4_1, at batch 1,
32 and 128.

Each side decodes `--output-len` tokens after 128-token random prompts (ignore_eos, greedy).
kvmesh sides: every prompt is prefilled in the first step, then the decode window is timed
step by step (tokens produced after the first token of every request / its wall time); for
the cupy backend also, per step, the GPU's milliseconds (CUDA events around the replay) and
the host's (the step's wall time less the GPU's).
transformers: (time of generate(N) - time of generate(1)) for batch x (N - 1) tokens.
llama.cpp: its own decode tok/s for the same prompt and output lengths; the F16 file is written
from the Q4_1 one (F32 through `kvmesh convert`, then llama-quantize). Also printed: the batch-1
bandwidth limit (weight bytes / peak bandwidth) and the ratios; --json writes every figure.

--shape llama3-8b: a random-weight F16 GGUF in Llama-3.1-8B's shapes (loadtest/model_shapes.py,
written once into --work-dir), the cupy backend against llama.cpp F16 on that same file.
Run: make bench-gpu  (BENCH_GPU_ARGS='--shape llama3-8b')
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.convert import gguf_to_f32
from kvmesh.engine import Engine
from loadtest import llama_cpp
from loadtest.kernel_bench import device_name, peak_bandwidth_gb_s
from loadtest.model_shapes import SHAPES, write_random_gguf
from services.engine_worker.cupy_backend.step_timing import StepTiming
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.model_paths import default_model_path
from shared.sampling import SamplingParams

BATCHES = (1, 32, 128)
PROMPT_LEN = 128


def prompts(batch: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)] for _ in range(batch)]


@dataclass
class DecodeFigures:
    tok_s: float
    gpu_ms: float | None = None  # per decode step, mean (cupy only)
    host_ms: float | None = None  # per decode step: wall time less the GPU's


def kvmesh_decode(
    backend: str, dtype: str, batch: int, output_len: int, model: str | None, kv_bytes: int
) -> tuple[DecodeFigures, Engine]:
    os.environ["KVMESH_TORCH_DEVICE"] = "cuda" if backend == "torch" else "cpu"
    engine = Engine(
        EngineConfig(
            model=model,
            backend=backend,
            dtype=dtype,
            cache=CacheConfig(kv_memory_bytes=kv_bytes),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=batch * PROMPT_LEN, max_num_seqs=batch
            ),
        )
    )
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    vocab = engine.worker.architecture.vocab_size
    engine.generate(prompts(batch, 1, vocab), warm)  # loads kernels
    timing = None
    if backend == "cupy":
        timing = engine.worker.runner.timing = StepTiming()
    for prompt in prompts(batch, 0, vocab):
        engine.add_request(prompt, params)
    started: set[str] = set()
    window_start, window_tokens = 0.0, 0
    walls: list[float] = []
    gpu: list[float] = []
    while engine.has_unfinished():
        counted = len(timing.gpu_ms) if timing is not None else 0
        step_start = time.perf_counter()
        outputs = engine.step()
        in_window = len(started) == batch
        if in_window and timing is not None and len(timing.gpu_ms) == counted + 1:
            walls.append((time.perf_counter() - step_start) * 1e3)
            gpu.append(timing.gpu_ms[-1])
        if len(started) == batch:
            window_tokens += sum(len(o.new_token_ids) for o in outputs)
        for output in outputs:
            started.add(output.request_id)
        if len(started) == batch and not window_start:
            if torch.cuda.is_available():  # the torch backend's queued work
                torch.cuda.synchronize()
            window_start = time.perf_counter()
    elapsed = time.perf_counter() - window_start
    figures = DecodeFigures(window_tokens / elapsed)
    if gpu:
        figures.gpu_ms = statistics.fmean(gpu)
        figures.host_ms = statistics.fmean(w - g for w, g in zip(walls, gpu, strict=True))
    return figures, engine


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


def llama_cpp_decode_tok_s(
    args: argparse.Namespace, output_len: int, files: dict[str, str | None]
) -> dict[str, dict]:
    """{kind: {batch: tok/s}} from llama.cpp's CUDA build, for each file; an F16 file that is
    None is written from the Q4_1 one."""
    bin_dir = Path(args.llama_bin) if args.llama_bin else llama_cpp.build(cuda_arch=args.cuda_arch)
    scratch = tempfile.TemporaryDirectory()
    if "F16" in files and files["F16"] is None:
        f32 = os.path.join(scratch.name, "model.F32.gguf")
        gguf_to_f32(str(files["Q4_1"]), f32)
        f16 = os.path.join(scratch.name, "model.F16.gguf")
        files = {**files, "F16": llama_cpp.quantize(bin_dir, f32, f16, "F16")}
    figures = {}
    for kind, path in files.items():
        rows = llama_cpp.batched_bench(
            bin_dir, str(path), list(args.batches), PROMPT_LEN, output_len, os.cpu_count() or 1, 99
        )
        figures[kind] = {row.batch: row.decode_tok_s for row in rows}
    scratch.cleanup()
    return figures


def shape_model(args: argparse.Namespace) -> str:
    """The random-weight F16 GGUF of --shape, written into --work-dir unless there already."""
    path = Path(args.work_dir) / f"{args.shape}.F16.gguf"
    if not path.exists():
        started = time.perf_counter()
        partial = path.with_suffix(".partial")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_gguf(
            args.tokenizer_from or default_model_path(), str(partial), SHAPES[args.shape]
        )
        partial.rename(path)
        seconds = time.perf_counter() - started
        print(f"wrote {path} ({path.stat().st_size / 1e9:.1f} GB) in {seconds:.0f} s")
    return str(path)


def _print_row(row: dict) -> None:
    tok_s = {k: v for k, v in row.items() if k not in ("batch", "cupy_gpu_ms", "cupy_host_ms")}
    peers = " | ".join(f"{name} {value:>8.0f}" for name, value in tok_s.items() if value)
    ours = float(row["kvmesh_cupy"])
    ratios = " ".join(
        f"cupy/{name} {ours / float(value):.2f}x"
        for name, value in tok_s.items()
        if name != "kvmesh_cupy" and value
    )
    step = ""
    if row.get("cupy_gpu_ms") is not None:
        step = f" | step: GPU {row['cupy_gpu_ms']:.3f} ms, host {row['cupy_host_ms']:.3f} ms"
    print(f"batch {row['batch']:>4}: {peers} tok/s | {ratios}{step}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="default", choices=["default", *sorted(SHAPES)])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--batches", type=lambda text: [int(b) for b in text.split(",")], default=list(BATCHES)
    )
    parser.add_argument("--llama-bin", help="llama.cpp CUDA binaries (default: build them)")
    parser.add_argument("--cuda-arch", default="90", help="for the llama.cpp build")
    parser.add_argument("--q4-model", help="llama.cpp's Q4_1 file (default: the default model)")
    parser.add_argument("--f16-model", help="an F16 GGUF of the same weights (default: written)")
    parser.add_argument(
        "--work-dir", default=tempfile.gettempdir(), help="--shape's GGUF goes here"
    )
    parser.add_argument("--tokenizer-from", help="--shape: the GGUF whose tokenizer to take")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument(
        "--llama-cpp-only",
        action="store_true",
        help="no torch backend or transformers beside llama.cpp (the GPU check's time)",
    )
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    peak = peak_bandwidth_gb_s()
    default = args.shape == "default"
    model = None if default else shape_model(args)
    print(
        f"{device_name()}, peak {peak:.0f} GB/s; {args.shape} model's shapes, {args.dtype}, "
        f"prompts {PROMPT_LEN} tokens, {args.output_len} decoded"
    )
    files: dict[str, str | None] = (
        {"F16": args.f16_model, "Q4_1": args.q4_model or default_model_path()}
        if default
        else {"F16": model}
    )
    llama = {} if args.no_llama_cpp else llama_cpp_decode_tok_s(args, args.output_len, files)
    kv_bytes = (4 if default else 16) << 30  # 128 x 256 tokens of Llama-3-8B: 4 GiB
    rows: list[dict] = []
    graphs: dict[str, str] | None = None
    num_parameters = 0
    for batch in args.batches:
        cupy, engine = kvmesh_decode("cupy", args.dtype, batch, args.output_len, model, kv_bytes)
        num_parameters, graphs = (
            engine.worker.manifest.num_parameters,
            engine.worker.manifest.cuda_graphs,
        )
        del engine
        gc.collect()  # its device arrays back to the pool before the next batch's engine
        row: dict = {"batch": batch, "kvmesh_cupy": cupy.tok_s}
        if default and not args.llama_cpp_only:  # slow peers, only where the model is small
            torch_side, engine = kvmesh_decode(
                "torch", args.dtype, batch, args.output_len, model, kv_bytes
            )
            del engine
            row["kvmesh_torch"] = torch_side.tok_s
            row["transformers"] = transformers_decode_tok_s(args.dtype, batch, args.output_len)
        row.update({f"llama_cpp_{kind}": figures.get(batch) for kind, figures in llama.items()})
        row.update(cupy_gpu_ms=cupy.gpu_ms, cupy_host_ms=cupy.host_ms)
        rows.append(row)
        _print_row(row)
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
            "shape": args.shape,
            "dtype": args.dtype,
            "prompt_len": PROMPT_LEN,
            "output_len": args.output_len,
            "cuda_graphs": graphs,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
