"""Launcher of rotary.cu."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec, kernel


def rotary(
    qkv: Any,
    positions: Any,
    cos: Any,
    sin: Any,
    num_rotated_heads: int,
    head_dim: int,
    spec: DTypeSpec,
) -> None:
    """In place on the first `num_rotated_heads` heads (Q then K) of each fused QKV row.
    cos/sin: float32 (max_positions, head_dim / 2); positions int32 (T,)."""
    tokens, row_stride = qkv.shape
    if tokens:
        kernel("rotary", f"rotary_{spec.suffix}")(
            (tokens,),
            (128,),
            (
                qkv,
                positions,
                cos,
                sin,
                numpy.int32(row_stride),
                numpy.int32(num_rotated_heads),
                numpy.int32(head_dim),
            ),
        )
