"""Launcher of bias_add.cu."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec, kernel


def bias_add(out: Any, bias: Any, spec: DTypeSpec) -> None:
    """out (T, N) += bias (N,)."""
    rows, columns = out.shape
    if rows:
        kernel("bias_add", f"bias_add_{spec.suffix}")(
            (rows,), (256,), (out, bias, numpy.int32(columns))
        )
