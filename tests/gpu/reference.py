"""Moving tensors between torch (CPU, the reference) and CuPy arrays of a storage type, and
the tolerances each dtype is held to."""

from __future__ import annotations

from typing import Any

import cupy
import numpy
import torch

from services.engine_worker.cupy_backend.kernels.library import DTYPES, DTypeSpec
from services.engine_worker.cupy_backend.model import to_device

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Absolute and relative tolerance per dtype: fp32 sees only summation order; 16-bit outputs
# are rounded once to their 8 (bf16) or 11 (fp16) significant bits.
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
SPECS = [DTYPES[name] for name in ("float32", "float16", "bfloat16")]


def put(tensor: torch.Tensor, spec: DTypeSpec) -> Any:
    return to_device(tensor.to(TORCH_DTYPES[spec.name]), spec)


def put_int(values: torch.Tensor | list, dtype: Any = numpy.int32) -> Any:
    return cupy.asarray(numpy.asarray(values, dtype=dtype))


def get(array: Any, spec: DTypeSpec) -> torch.Tensor:
    """A CuPy array of the storage type back as a float32 CPU tensor."""
    host = cupy.asnumpy(array)
    if spec.name == "bfloat16":
        return torch.from_numpy(host.view(numpy.int16)).view(torch.bfloat16).float()
    return torch.from_numpy(host).float()


def rounded(tensor: torch.Tensor, spec: DTypeSpec) -> torch.Tensor:
    """What the kernel sees of an input: the tensor at the storage precision, as float32."""
    return tensor.to(TORCH_DTYPES[spec.name]).float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, spec: DTypeSpec) -> None:
    tolerance = TOLERANCE[spec.name]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
