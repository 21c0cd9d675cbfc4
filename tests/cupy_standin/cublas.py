"""The stand-in's `nvmath.bindings.cublas`: handles, and gemm_ex on raw pointers, in numpy.

A GEMM finds its operands from their pointers and leading dimensions (device.host_memory:
a pointer or extent outside every live buffer fails), reads alpha and beta from host memory
when issued (pointer mode host), and computes in float32. While a stream captures it is
recorded like a kernel, provided the handle was readied as a capture needs: bound to the
capturing stream, given a workspace (else cuBLAS would allocate one inside the capture), in
host pointer mode.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass

import numpy

from tests.cupy_standin import device
from tests.cupy_standin.kernels import rounded, to_float

_STORAGE = {0: (numpy.float32, "f32"), 2: (numpy.float16, "f16"), 14: (numpy.uint16, "bf16")}
_OP_N, _POINTER_MODE_HOST, _COMPUTE_32F = 0, 0, 68


@dataclass
class Handle:
    stream: int = 0
    workspace: int = 0
    pointer_mode: int = -1


_handles: dict[int, Handle] = {}
_ids = itertools.count(1)


def reset() -> None:
    _handles.clear()


def create() -> int:
    handle = next(_ids)
    _handles[handle] = Handle()
    return handle


def destroy(handle: int) -> None:
    del _handles[handle]


def set_stream(handle: int, stream: int) -> None:
    _handles[handle].stream = stream


def set_workspace(handle: int, workspace: int, size: int) -> None:
    device.host_memory(workspace, size)  # a live buffer of that size
    _handles[handle].workspace = workspace


def set_pointer_mode(handle: int, mode: int) -> None:
    _handles[handle].pointer_mode = mode


def _matrix(pointer: int, cuda_type: int, rows: int, columns: int, lead: int) -> numpy.ndarray:
    """A column-major (rows x columns) operand with leading dimension `lead`, as the
    row-major (columns, rows) array over the same memory."""
    dtype, _ = _STORAGE[cuda_type]
    itemsize = numpy.dtype(dtype).itemsize
    if lead < rows:
        raise ValueError(f"leading dimension {lead} < {rows} rows")
    extent = ((columns - 1) * lead + rows) * itemsize
    memory = device.host_memory(pointer, extent).view(dtype)
    return numpy.lib.stride_tricks.as_strided(
        memory, (columns, rows), (lead * itemsize, itemsize), writeable=True
    )


def gemm_ex(
    handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int,
    a: int, atype: int, lda: int, b: int, btype: int, ldb: int, beta: int,
    c: int, ctype: int, ldc: int, compute_type: int, algo: int,
) -> None:  # fmt: skip
    state = _handles[handle]
    if (transa, transb, compute_type) != (_OP_N, _OP_N, _COMPUTE_32F):
        raise NotImplementedError("the stand-in runs untransposed GEMMs with fp32 compute")
    if state.pointer_mode != _POINTER_MODE_HOST:
        raise ValueError("alpha and beta are host pointers: set the host pointer mode")
    graph = device.STATE.capturing
    if graph is not None:
        if state.stream != graph.stream.ptr:
            device.refuse_in_capture("a GEMM on a stream that is not capturing")
        if not state.workspace:
            device.refuse_in_capture("a GEMM whose handle has no workspace (cuBLAS allocates)")
    scale = ctypes.c_float.from_address(alpha).value
    keep = ctypes.c_float.from_address(beta).value
    left = _matrix(a, atype, m, k, lda)  # (k, m): A^T, the row-major weight
    right = _matrix(b, btype, k, n, ldb)  # (n, k): the row-major input
    out = _matrix(c, ctype, m, n, ldc)  # (n, m)

    def run() -> None:
        product = scale * (to_float(right, _STORAGE[btype][1]) @ to_float(left, _STORAGE[atype][1]))
        if keep:
            product += keep * to_float(out, _STORAGE[ctype][1])
        out[...] = rounded(product, _STORAGE[ctype][1])

    device.launch("gemm", run)
