"""Launcher of rotary_and_cache.cu."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import NULL, DTypeSpec, kernel


def rotary_and_cache(
    qkv: Any,
    bias: Any | None,
    positions: Any,
    cos: Any,
    sin: Any,
    slots: Any,
    key_cache: Any,
    value_cache: Any,
    num_heads: int,
    spec: DTypeSpec,
) -> None:
    """In place on each fused QKV row (T, (H + 2 KV) * D): bias added (if given), Q and K heads
    rotated; then its K and V into the caches (blocks, kv_heads, block, D) at its slot (int64,
    -1: skip). cos/sin float32 (max_positions, D / 2); positions int32 (T,)."""
    tokens, row_stride = qkv.shape
    _, kv_heads, block_size, head_dim = key_cache.shape
    if tokens:
        kernel("rotary_and_cache", f"rotary_and_cache_{spec.suffix}")(
            (tokens,),
            (128,),
            (
                qkv,
                NULL if bias is None else bias,
                positions,
                cos,
                sin,
                slots,
                key_cache,
                value_cache,
                numpy.int32(row_stride),
                numpy.int32(num_heads),
                numpy.int32(kv_heads),
                numpy.int32(head_dim),
                numpy.int32(block_size),
            ),
        )
