"""Paged decode attention against the GPU's memory bandwidth (needs an NVIDIA GPU and CuPy).

Decode attention reads every cached K and V byte of every sequence once per step, and little
else: achieved bandwidth = (K + V bytes read) / kernel time, against the device's peak
(memory clock x 2 (DDR) x bus width, from the driver). Contexts 1k / 8k / 32k, batch 1 / 32 /
128, for SmolLM2-135M's heads (9 query, 3 KV, dim 64) and a Llama-3-8B layer's (32, 8, 128),
fp16 and bf16, block size 16, each context's blocks scattered over the pool.
Goal: >= 70% of peak at long contexts. Run: make bench-kernels
"""

from __future__ import annotations

import argparse

import cupy
import numpy

from services.engine_worker.cupy_backend.kernels.library import DTYPES
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import (
    DecodeScratch,
    num_splits,
    paged_decode_attention,
)

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def peak_bandwidth_gb_s() -> float:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props["memoryClockRate"] * 1e3 * 2 * props["memoryBusWidth"] / 8 / 1e9


def device_name() -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def random_storage(shape: tuple[int, ...], spec) -> cupy.ndarray:  # type: ignore[no-untyped-def]
    """Normal values in the storage type (bf16: the top half of each fp32's bits)."""
    values = cupy.random.standard_normal(shape, dtype=numpy.float32)
    if spec.name == "bfloat16":
        return (values.view(numpy.uint32) >> 16).astype(numpy.uint16)
    return values.astype(spec.storage)


def time_ms(launch, repeats: int) -> float:  # type: ignore[no-untyped-def]
    launch()  # warm-up: module load
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        launch()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeats


def bench(
    shape: str, dtype: str, batch: int, context: int, block: int, repeats: int
) -> tuple[float, float]:
    num_heads, kv_heads, head_dim = SHAPES[shape]
    spec = DTYPES[dtype]
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, kv_heads, block, head_dim)
    keys, values = random_storage(cache_shape, spec), random_storage(cache_shape, spec)
    order = cupy.random.permutation(num_blocks).astype(numpy.int32)
    tables = order.reshape(batch, blocks_per_seq)  # each context's blocks scattered
    lens = cupy.full(batch, context, numpy.int32)
    qkv = random_storage((batch, (num_heads + 2 * kv_heads) * head_dim), spec)
    out = cupy.empty((batch, num_heads * head_dim), spec.storage)
    scratch = DecodeScratch.allocate(batch, num_heads, num_splits(context), head_dim)

    def launch() -> None:
        paged_decode_attention(
            out, qkv, keys, values, tables, lens, num_heads, head_dim**-0.5, scratch, spec
        )

    milliseconds = time_ms(launch, repeats)
    bytes_read = 2 * batch * context * kv_heads * head_dim * spec.itemsize
    return milliseconds, bytes_read / milliseconds / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    peak = peak_bandwidth_gb_s()
    print(f"{device_name()}: peak memory bandwidth {peak:.0f} GB/s (driver's clock x bus width)")
    print(f"{'heads':<14}{'dtype':<10}{'batch':>6}{'context':>9}{'ms':>10}{'GB/s':>9}{'% peak':>8}")
    for shape in SHAPES:
        for dtype in ("float16", "bfloat16"):
            for context in (1024, 8192, 32768):
                for batch in (1, 32, 128):
                    ms, gb_s = bench(shape, dtype, batch, context, args.block_size, args.repeats)
                    cupy.get_default_memory_pool().free_all_blocks()  # the next pool may be big
                    print(
                        f"{shape:<14}{dtype:<10}{batch:>6}{context:>9}{ms:>10.3f}"
                        f"{gb_s:>9.0f}{gb_s / peak * 100:>7.1f}%",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
