"""Launcher of paged_prefill_attention.cu (ragged causal prefill over cached prefixes)."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec, kernel

QUERIES_PER_BLOCK = 4  # a warp per query


def paged_prefill_attention(
    out: Any,
    qkv: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    query_starts: Any,
    context_lens: Any,
    max_query_len: int,
    num_heads: int,
    scale: float,
    spec: DTypeSpec,
    window: int = 0,
) -> None:
    """Rows query_starts[s]..query_starts[s + 1] of out (T, H * D) for each prefill sequence s;
    its chunk is the last tokens of its context_lens[s], already written to the cache.
    block_tables int32 (N, max_blocks); query_starts int32 (N + 1,); context_lens int32 (N,).
    `window` > 0: a sliding layer's, each query sees its last `window` positions only."""
    num_seqs, max_blocks = block_tables.shape
    _, kv_heads, block_size, head_dim = key_cache.shape
    if not num_seqs:
        return
    kernel("paged_prefill_attention", f"paged_prefill_attention_{spec.suffix}_d{head_dim}")(
        (-(-max_query_len // QUERIES_PER_BLOCK), num_seqs, num_heads),
        (32 * QUERIES_PER_BLOCK,),
        (
            out,
            numpy.int32(out.shape[1]),
            qkv,
            numpy.int32(qkv.shape[1]),
            key_cache,
            value_cache,
            block_tables,
            numpy.int32(max_blocks),
            query_starts,
            context_lens,
            numpy.int32(num_heads),
            numpy.int32(kv_heads),
            numpy.int32(block_size),
            numpy.float32(scale),
            numpy.int32(window),
        ),
    )
