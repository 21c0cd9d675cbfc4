"""Launcher of embedding.cu."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec, kernel


def embedding(out: Any, table: Any, ids: Any, spec: DTypeSpec) -> None:
    """out (T, hidden) = table[ids]; ids int32 (T,)."""
    tokens, hidden = out.shape
    if tokens:
        kernel("embedding", f"embedding_{spec.suffix}")(
            (tokens,), (256,), (out, table, ids, numpy.int32(hidden))
        )
