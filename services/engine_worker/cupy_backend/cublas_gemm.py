"""The one cuBLAS call the GPU model makes: a row-major GEMM with fp32 accumulation."""

from __future__ import annotations

from typing import Any

import cupy
import numpy
from cupy.cuda import cublas

from services.engine_worker.cupy_backend.kernels.library import DTypeSpec

CUDA_R_32F = 0  # cudaDataType for fp32 output (the logits)
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation whatever the storage type
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT: cuBLAS picks (tensor cores for 16-bit)
_ONE = numpy.ones((), numpy.float32)  # host scalars cuBLAS reads (pointer mode host)
_ZERO = numpy.zeros((), numpy.float32)


def gemm(x: Any, weight: Any, out: Any, spec: DTypeSpec, out_type: int | None = None) -> None:
    """out (T, N) = x (T, K) @ weight (K, N), row-major, through cublasGemmEx: read as
    column-major, that is out^T = weight^T @ x^T, so no transpose is needed."""
    tokens, inner = x.shape
    columns = weight.shape[1]
    if not tokens:
        return
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.gemmEx(
        handle,
        cublas.CUBLAS_OP_N,
        cublas.CUBLAS_OP_N,
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
