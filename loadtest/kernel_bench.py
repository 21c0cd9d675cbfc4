"""The GPU step kernel by kernel, and decode attention against the memory's bandwidth (needs an
NVIDIA GPU and CuPy).

Part 1, each kernel's microseconds in one decode step at bench-gpu's own contexts (128-token
prompts, 128 decoded: ~192 positions on average), batch 1 / 32 / 128, for SmolLM2-135M's shapes
and Llama-3.1-8B's: the layer's launches, the ones outside the layers, and their sum as the
GPU milliseconds of a step (bench-gpu measures the replayed step itself).
Part 2, decode attention's achieved bandwidth: it reads every cached K and V byte of every
sequence once per step and little else, so (K + V bytes) / kernel time against the device's
peak (memory clock x 2 (DDR) x bus width, from the driver). Contexts 1k / 8k / 32k, batch 1 /
32 / 128, both shapes' heads, bf16, block size 16, each context's blocks scattered over the
pool. Goals: >= 70% of peak at batch >= 32 and context >= 8k, <= 15 us at batch 1 and 1k.
Run: make bench-kernels
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import cupy
import numpy

from services.engine_worker.cupy_backend.cublas_gemm import CUDA_R_32F, CublasGemm
from services.engine_worker.cupy_backend.kernels.library import DTYPES, DTypeSpec
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
    DecodeScratch,
    FusedWrite,
    grid_splits,
    paged_decode_attention,
)
from services.engine_worker.cupy_backend.kernels.rms_norm import add_rms_norm
from services.engine_worker.cupy_backend.kernels.sample_tokens import (
    MAX_TOP,
    ROW_FIELDS,
    SamplingRows,
    sample_tokens,
)
from services.engine_worker.cupy_backend.kernels.silu_and_mul import silu_and_mul

BLOCK = 16
BATCHES = (1, 32, 128)


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    layers: int


SHAPES = {
    "smollm2-135m": Shape(9, 3, 64, 576, 1536, 49152, 30),
    "llama3-8b": Shape(32, 8, 128, 4096, 14336, 128256, 32),
}


def peak_bandwidth_gb_s() -> float:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props["memoryClockRate"] * 1e3 * 2 * props["memoryBusWidth"] / 8 / 1e9


def device_name() -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def sm_count() -> int:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return int(props["multiProcessorCount"])


def random_storage(shape: tuple[int, ...], spec: DTypeSpec, std: float = 1.0) -> cupy.ndarray:
    """Normal values in the storage type (bf16: the top half of each fp32's bits)."""
    values = cupy.random.standard_normal(shape, dtype=numpy.float32) * std
    if spec.name == "bfloat16":
        return (values.view(numpy.uint32) >> 16).astype(numpy.uint16)
    return values.astype(spec.storage)


def time_us(launch: Callable[[], None], repeats: int) -> float:
    launch()  # warm-up: module load, cuBLAS's choice
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        launch()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeats * 1e3


def attention_inputs(shape: Shape, batch: int, context: int, spec: DTypeSpec) -> dict:
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shape.kv_heads, BLOCK, shape.head_dim)
    order = cupy.random.permutation(num_blocks).astype(numpy.int32)
    splits = grid_splits(batch, shape.kv_heads, sm_count())
    scratch = DecodeScratch.allocate(batch, shape.heads, shape.kv_heads, splits, shape.head_dim)
    return {
        "keys": random_storage(cache_shape, spec),
        "values": random_storage(cache_shape, spec),
        "tables": order.reshape(batch, blocks_per_seq),  # each context's blocks scattered
        "lens": cupy.full(batch, context, numpy.int32),
        "scratch": scratch,
    }


def attention_launch(shape: Shape, batch: int, inputs: dict, spec: DTypeSpec, qkv, fused):  # type: ignore[no-untyped-def]
    out = cupy.empty((batch, shape.heads * shape.head_dim), spec.storage)
    return lambda: paged_decode_attention(
        out, qkv, inputs["keys"], inputs["values"], inputs["tables"], inputs["lens"],
        shape.heads, shape.head_dim**-0.5, inputs["scratch"], spec, fused,
    )  # fmt: skip


def step_kernels(name: str, batch: int, context: int, spec: DTypeSpec, repeats: int) -> dict:
    """Microseconds of each launch of a decode step at these shapes (one layer's weights)."""
    shape = SHAPES[name]
    gemm = CublasGemm(cupy.cuda.get_current_stream())
    qkv_width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    x = random_storage((batch, shape.hidden), spec)
    normed, proj = cupy.empty_like(x), cupy.empty_like(x)
    weights = {
        "qkv": random_storage((shape.hidden, qkv_width), spec, 0.02),
        "o_proj": random_storage((shape.heads * shape.head_dim, shape.hidden), spec, 0.02),
        "gate_up": random_storage((shape.hidden, 2 * shape.ffn), spec, 0.02),
        "down": random_storage((shape.ffn, shape.hidden), spec, 0.02),
        "lm_head": random_storage((shape.hidden, shape.vocab), spec, 0.02),
        "norm": random_storage((shape.hidden,), spec),
    }
    qkv = random_storage((batch, qkv_width), spec)
    attn = cupy.empty((batch, shape.heads * shape.head_dim), spec.storage)
    gate_up = cupy.empty((batch, 2 * shape.ffn), spec.storage)
    act = cupy.empty((batch, shape.ffn), spec.storage)
    logits = cupy.empty((batch, shape.vocab), numpy.float32)
    tokens, logprobs = cupy.empty(batch, numpy.int32), cupy.empty(batch, numpy.float32)
    top_ids = cupy.empty((batch, MAX_TOP), numpy.int32)
    top_logprobs = cupy.empty((batch, MAX_TOP), numpy.float32)
    # top-p 0.9 at temperature 0.8: the kernel's longest path (bisection passes, the scan)
    row_values = {"temperatures": 0.8, "top_ps": 0.9, "keys": 7}
    sampled_rows = SamplingRows(
        **{
            name: cupy.full(batch, row_values.get(name, default), dtype)
            for name, dtype, default in ROW_FIELDS
        },
        adjustments=cupy.zeros((1, 4), numpy.float32),  # no penalties
    )
    inputs = attention_inputs(shape, batch, context, spec)
    angles = cupy.random.random((context + 1, shape.head_dim // 2), dtype=numpy.float32)
    fused = FusedWrite(
        None,
        cupy.full(batch, context - 1, numpy.int32),
        cupy.cos(angles),
        cupy.sin(angles),
        cupy.full(batch, -1, numpy.int64),  # timing only: nothing written
    )
    layer = {
        "input_norm": lambda: add_rms_norm(normed, x, weights["norm"], 1e-5, spec, delta=proj),
        "qkv_gemm": lambda: gemm(normed, weights["qkv"], qkv, spec),
        "attention": attention_launch(shape, batch, inputs, spec, qkv, fused),
        "o_gemm": lambda: gemm(attn, weights["o_proj"], proj, spec),
        "post_norm": lambda: add_rms_norm(normed, x, weights["norm"], 1e-5, spec, delta=proj),
        "gate_up_gemm": lambda: gemm(normed, weights["gate_up"], gate_up, spec),
        "silu_and_mul": lambda: silu_and_mul(act, gate_up, spec),
        "down_gemm": lambda: gemm(act, weights["down"], proj, spec),
    }
    outside = {
        "final_norm": lambda: add_rms_norm(normed, x, weights["norm"], 1e-5, spec, delta=proj),
        "lm_head": lambda: gemm(normed, weights["lm_head"], logits, spec, out_type=CUDA_R_32F),
        "sample_tokens": lambda: sample_tokens(
            logits, sampled_rows, tokens, logprobs, top_ids, top_logprobs
        ),
    }
    timed = {k: time_us(f, repeats) for k, f in {**layer, **outside}.items()}
    gemm.close()
    per_layer = sum(timed[k] for k in layer)
    timed["step_ms"] = (per_layer * shape.layers + sum(timed[k] for k in outside)) / 1e3
    return timed


def attention_bandwidth(
    name: str, batch: int, context: int, spec: DTypeSpec, repeats: int
) -> tuple[float, float]:
    """(microseconds, GB/s) of decode attention over `batch` contexts of `context` positions."""
    shape = SHAPES[name]
    inputs = attention_inputs(shape, batch, context, spec)
    qkv = random_storage((batch, (shape.heads + 2 * shape.kv_heads) * shape.head_dim), spec)
    micros = time_us(attention_launch(shape, batch, inputs, spec, qkv, None), repeats)
    bytes_read = 2 * batch * context * shape.kv_heads * shape.head_dim * spec.itemsize
    return micros, bytes_read / micros / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=192, help="part 1's positions per row")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    args = parser.parse_args()
    spec = DTYPES[args.dtype]
    peak = peak_bandwidth_gb_s()
    print(f"{device_name()}, {sm_count()} SMs: peak memory bandwidth {peak:.0f} GB/s")
    for name in SHAPES:
        for batch in BATCHES:
            timed = step_kernels(name, batch, args.context, spec, args.repeats)
            cupy.get_default_memory_pool().free_all_blocks()
            kernels = " ".join(f"{k} {v:.1f}" for k, v in timed.items() if k != "step_ms")
            print(
                f"{name} batch {batch}, context {args.context} (us): {kernels} | "
                f"sum for a step {timed['step_ms']:.3f} ms",
                flush=True,
            )
    print(f"{'heads':<14}{'batch':>6}{'context':>9}{'us':>10}{'GB/s':>9}{'% peak':>8}")
    for name in SHAPES:
        for context in (1024, 8192, 32768):
            for batch in BATCHES:
                micros, gb_s = attention_bandwidth(name, batch, context, spec, args.repeats)
                cupy.get_default_memory_pool().free_all_blocks()  # the next pool may be big
                print(
                    f"{name:<14}{batch:>6}{context:>9}{micros:>10.1f}"
                    f"{gb_s:>9.0f}{gb_s / peak * 100:>7.1f}%",
                    flush=True,
                )


if __name__ == "__main__":
    main()
