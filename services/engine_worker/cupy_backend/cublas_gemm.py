"""The GPU model's GEMMs: cuBLAS on a handle of our own, safe to capture in a CUDA graph.

CuPy's own cuBLAS wrapper refuses every call while a stream captures (cupy/cupy#6290), so the
decode graphs could not hold a single GEMM. nvmath-python's bindings call cuBLAS with no such
guard, and everything cuBLAS would otherwise do lazily inside a call is settled here once,
before any capture: the stream is bound, the workspace is ours (cuBLAS never allocates during
a capture) and alpha and beta are host scalars, read when a GEMM is issued and so baked into
the graph as constants.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy
from nvmath.bindings import cublas

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec

CUDA_R_32F = 0  # cudaDataType for fp32 output (the logits)
# cuBLAS asks for 32 MiB of workspace on Hopper (4 MiB before it) for its fastest kernels.
WORKSPACE_BYTES = 32 << 20
_OP_N = 0  # CUBLAS_OP_N
_POINTER_MODE_HOST = 0  # CUBLAS_POINTER_MODE_HOST
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation whatever the storage type
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT: cuBLAS picks (tensor cores for 16-bit)
_ONE = numpy.ones((), numpy.float32)  # the host scalars cuBLAS reads
_ZERO = numpy.zeros((), numpy.float32)


class CublasGemm:
    """Row-major GEMMs with fp32 accumulation on `stream`, through one cuBLAS handle."""

    def __init__(self, stream: Any) -> None:
        self.handle = cublas.create()
        cublas.set_stream(self.handle, stream.ptr)
        with stream:
            self.workspace = cupy.empty(WORKSPACE_BYTES, numpy.uint8)
        cublas.set_workspace(self.handle, self.workspace.data.ptr, WORKSPACE_BYTES)
        cublas.set_pointer_mode(self.handle, _POINTER_MODE_HOST)

    def __call__(
        self, x: Any, weight: Any, out: Any, spec: DTypeSpec, out_type: int | None = None
    ) -> None:
        """out (T, N) = x (T, K) @ weight (K, N), row-major: read as column-major that is
        out^T = weight^T @ x^T, so neither operand is transposed."""
        tokens, inner = x.shape
        columns = weight.shape[1]
        if not tokens:
            return
        cublas.gemm_ex(
            self.handle,
            _OP_N,
            _OP_N,
            columns,
            tokens,
            inner,
            _ONE.ctypes.data,
            weight.data.ptr,
            spec.cuda_type,
            columns,
            x.data.ptr,
            spec.cuda_type,
            inner,
            _ZERO.ctypes.data,
            out.data.ptr,
            spec.cuda_type if out_type is None else out_type,
            columns,
            _COMPUTE_32F,
            _GEMM_DEFAULT,
        )

    def close(self) -> None:
        if self.handle:
            cublas.destroy(self.handle)
            self.handle = 0
