"""Launcher of reshape_and_cache.cu."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec, kernel


def reshape_and_cache(
    key_cache: Any,
    value_cache: Any,
    qkv: Any,
    slots: Any,
    q_size: int,
    kv_heads: int,
    head_dim: int,
    spec: DTypeSpec,
) -> None:
    """K and V of each fused QKV row into the cache (blocks, kv_heads, block, D) at its slot
    (int64, -1: skip)."""
    tokens, row_stride = qkv.shape
    if tokens:
        kernel("reshape_and_cache", f"reshape_and_cache_{spec.suffix}")(
            (tokens,),
            (128,),
            (
                key_cache,
                value_cache,
                qkv,
                slots,
                numpy.int32(row_stride),
                numpy.int32(q_size),
                numpy.int32(q_size + kv_heads * head_dim),
                numpy.int32(kv_heads),
                numpy.int32(head_dim),
                numpy.int32(key_cache.shape[2]),
            ),
        )
