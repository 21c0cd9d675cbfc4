"""Launcher of rms_norm.cu."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import NULL, DTypeSpec, kernel


def _threads(hidden: int) -> tuple[int]:
    return (min(1024, max(32, hidden // 32 * 32)),)


def add_rms_norm(
    out: Any,
    residual: Any,
    weight: Any,
    eps: float,
    spec: DTypeSpec,
    delta: Any = None,
    rows: Any = None,
) -> None:
    """residual += delta (if given); out = rms_norm(residual) * weight. With `rows` (int32),
    out row r is residual row rows[r] (only those rows are added to)."""
    num_rows, hidden = out.shape
    if num_rows:
        kernel("rms_norm", f"add_rms_norm_{spec.suffix}")(
            (num_rows,),
            _threads(hidden),
            (
                out,
                residual,
                NULL if delta is None else delta,
                weight,
                NULL if rows is None else rows,
                numpy.int32(hidden),
                numpy.float32(eps),
            ),
        )


def embed_rms_norm(
    out: Any,
    residual: Any,
    table: Any,
    ids: Any,
    weight: Any,
    eps: float,
    spec: DTypeSpec,
    scale: float = 1.0,
) -> None:
    """residual (T, hidden) = table[ids] * scale; out = rms_norm(residual) * weight. ids int32
    (T,); `scale`: Gemma's sqrt(hidden), as the compute dtype holds it."""
    num_rows, hidden = out.shape
    if num_rows:
        kernel("rms_norm", f"embed_rms_norm_{spec.suffix}")(
            (num_rows,),
            _threads(hidden),
            (
                out,
                residual,
                table,
                ids,
                weight,
                numpy.int32(hidden),
                numpy.float32(eps),
                numpy.float32(scale),
            ),
        )


def head_rms_norm(qkv: Any, weight: Any, eps: float, spec: DTypeSpec) -> None:
    """qkv (T, width): its first `heads` heads of `dim` values each RMS-normed in place, head
    h times weight[h] (weight: (heads, dim))."""
    tokens, width = qkv.shape
    heads, dim = weight.shape
    if tokens:
        kernel("rms_norm", f"head_rms_norm_{spec.suffix}")(
            (tokens * heads,),
            _threads(dim),
            (
                qkv,
                weight,
                numpy.int32(heads),
                numpy.int32(dim),
                numpy.int32(width),
                numpy.float32(eps),
            ),
        )
