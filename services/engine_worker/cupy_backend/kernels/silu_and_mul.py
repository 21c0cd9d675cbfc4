"""Launchers of silu_and_mul.cu: SwiGLU's and GeGLU's elementwise halves."""

from __future__ import annotations

from typing import Any

import numpy

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec, kernel


def silu_and_mul(out: Any, gate_up: Any, spec: DTypeSpec) -> None:
    """out (T, I) = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    tokens, inner = out.shape
    if tokens:
        kernel("silu_and_mul", f"silu_and_mul_{spec.suffix}")(
            (tokens,), (256,), (out, gate_up, numpy.int32(inner))
        )


def gelu_tanh_and_mul(out: Any, gate_up: Any, spec: DTypeSpec) -> None:
    """out (T, I) = gelu_tanh(gate_up[:, :I]) * gate_up[:, I:] (Gemma's GeGLU)."""
    tokens, inner = out.shape
    if tokens:
        kernel("silu_and_mul", f"gelu_tanh_and_mul_{spec.suffix}")(
            (tokens,), (256,), (out, gate_up, numpy.int32(inner))
        )
