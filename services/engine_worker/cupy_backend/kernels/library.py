"""Loading the kernel sources as CuPy modules, and the storage types they are built for.

CuPy has no bfloat16 array type of its own (only an experimental one through ml_dtypes), so
bf16 tensors live in uint16 arrays and each kernel is instantiated per storage type
(`<op>_f32`, `<op>_f16`, `<op>_bf16`); the DTypeSpec says which one a tensor needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy

KERNEL_DIR = Path(__file__).resolve().parent
NVRTC_OPTIONS = ("-std=c++17", f"-I{KERNEL_DIR}")
NULL = numpy.uint64(0)  # a null pointer argument


@dataclass(frozen=True)
class DTypeSpec:
    name: str  # float32 | float16 | bfloat16, as --dtype says
    suffix: str  # the kernels' instantiation suffix
    storage: type  # numpy dtype of the CuPy arrays holding it
    cuda_type: int  # cudaDataType for cuBLAS
    itemsize: int


DTYPES = {
    "float32": DTypeSpec("float32", "f32", numpy.float32, 0, 4),  # CUDA_R_32F
    "float16": DTypeSpec("float16", "f16", numpy.float16, 2, 2),  # CUDA_R_16F
    "bfloat16": DTypeSpec("bfloat16", "bf16", numpy.uint16, 14, 2),  # CUDA_R_16BF
}


def sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))


@functools.cache
def module(name: str, defines: tuple[str, ...] = ()) -> Any:
    """The compiled module of `<name>.cu` (NVRTC, for the current device; cached by CuPy).
    `defines` ("NAME=VALUE") narrow a file that instantiates many shapes to one."""
    import cupy

    code = (KERNEL_DIR / f"{name}.cu").read_text()
    options = NVRTC_OPTIONS + tuple(f"-D{define}" for define in defines)
    return cupy.RawModule(code=code, options=options)


@functools.cache
def kernel(name: str, function: str, defines: tuple[str, ...] = ()) -> Any:
    return module(name, defines).get_function(function)
