"""Launcher of paged_decode_attention.cu (split-K decode attention and its merge)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec, kernel

THREADS = 128
MAX_GROUP = 8  # query heads per KV head (kMaxGroup in the kernel)
HEAD_DIMS = (32, 64, 128)
PARTITION_SIZE = 512  # positions per split: long contexts spread over many blocks


@dataclass(frozen=True)
class DecodeScratch:
    """Per-split partial results, float32; sized for (seqs, heads, splits)."""

    out: Any  # (seqs, heads, splits, D)
    max: Any  # (seqs, heads, splits)
    sum: Any  # (seqs, heads, splits)

    @staticmethod
    def allocate(num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> DecodeScratch:
        import cupy

        shape = (num_seqs, num_heads, num_splits)
        return DecodeScratch(
            cupy.empty((*shape, head_dim), numpy.float32),
            cupy.empty(shape, numpy.float32),
            cupy.empty(shape, numpy.float32),
        )


def num_splits(max_context: int, partition_size: int = PARTITION_SIZE) -> int:
    return max(1, -(-max_context // partition_size))


def check_shape(num_heads: int, kv_heads: int, head_dim: int) -> None:
    if num_heads % kv_heads or num_heads // kv_heads > MAX_GROUP or head_dim not in HEAD_DIMS:
        raise ValueError(
            f"decode attention supports head_dim {HEAD_DIMS} and up to {MAX_GROUP} query heads "
            f"per KV head; got head_dim {head_dim}, {num_heads} heads, {kv_heads} KV heads"
        )


def paged_decode_attention(
    out: Any,
    qkv: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    context_lens: Any,
    num_heads: int,
    scale: float,
    scratch: DecodeScratch,
    spec: DTypeSpec,
    partition_size: int = PARTITION_SIZE,
) -> None:
    """out (S, H * D) for the first S rows of qkv (one query each). Caches are
    (blocks, kv_heads, block, D); block_tables int32 (S, max_blocks); context_lens int32 (S,),
    each >= 1. scratch must have room for S rows and enough splits for the longest context."""
    num_seqs, max_blocks = block_tables.shape
    _, kv_heads, block_size, head_dim = key_cache.shape
    check_shape(num_heads, kv_heads, head_dim)
    if not num_seqs:
        return
    splits = scratch.max.shape[2]
    group = num_heads // kv_heads
    shared = (group * head_dim + group * partition_size + 32) * 4
    kernel("paged_decode_attention", f"paged_decode_attention_{spec.suffix}_d{head_dim}")(
        (splits, num_seqs, kv_heads),
        (THREADS,),
        (
            scratch.out,
            scratch.max,
            scratch.sum,
            qkv,
            numpy.int32(qkv.shape[1]),
            key_cache,
            value_cache,
            block_tables,
            numpy.int32(max_blocks),
            context_lens,
            numpy.int32(num_heads),
            numpy.int32(kv_heads),
            numpy.int32(block_size),
            numpy.int32(partition_size),
            numpy.float32(scale),
        ),
        shared_mem=shared,
    )
    kernel("paged_decode_attention", f"paged_decode_reduce_{spec.suffix}")(
        (num_seqs, num_heads),
        (head_dim,),
        (out, scratch.out, scratch.max, scratch.sum, numpy.int32(splits), numpy.int32(head_dim)),
    )
