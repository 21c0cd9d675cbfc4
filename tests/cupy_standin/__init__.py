"""A CPU stand-in for CuPy and nvmath-python's cuBLAS bindings, so the real cupy backend
(runner, graphs, buckets, forks, drafts, sampling) runs in `make test` on any machine.

`installed()` puts the stand-in's `cupy`, `cupy.cuda`, `cupy.cuda.cublas` and
`nvmath.bindings.cublas` in sys.modules and imports the cupy backend afresh against them;
every RawKernel launch dispatches to its numpy reference (kernels.py), every GEMM to numpy
(cublas.py), and a stream capture records and enforces what a CUDA graph may hold
(device.py). On a machine with a GPU the same backend runs on the real modules
(tests/gpu/).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

from tests.cupy_standin import cublas, device
from tests.cupy_standin.kernels import host_args, reference

BACKEND_PACKAGE = "services.engine_worker.cupy_backend"


class RawKernel:
    def __init__(self, function: str) -> None:
        self.function = function
        self._reference = reference(function)

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        if not all(isinstance(n, int) and n >= 1 for n in (*grid, *block)):
            raise ValueError(f"{self.function}: grid {grid} and block {block} need positive ints")
        threads = 1
        for n in block:
            threads *= n
        if threads > 1024:
            raise ValueError(f"{self.function}: {threads} threads in a block (at most 1024)")
        if shared_mem > 48 << 10:  # more needs cudaFuncSetAttribute, which nothing calls
            raise ValueError(f"{self.function}: {shared_mem} bytes of dynamic shared memory")
        converted = host_args(args)
        device.launch(self.function, lambda: self._reference(self.function, grid, converted))


class RawModule:
    def __init__(self, code: str = "", options: tuple = (), **_: Any) -> None:
        self.code = code

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(name)


def _refusing_cupy_cublas() -> types.ModuleType:
    """CuPy's cuBLAS wrapper: refused in a capture as CuPy refuses it (cupy/cupy#6290);
    outside one a call is only counted (the backend has its own handle)."""
    module = types.ModuleType("cupy.cuda.cublas")

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> None:
            device.STATE.cupy_cublas_calls.append(name)
            # CuPy's own words: "calling cuBLAS API during stream capture is unsupported".
            device.refuse_in_capture(
                f"cupy.cuda.cublas.{name} (CuPy refuses cuBLAS during stream capture)",
                NotImplementedError,
            )

        return call

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _modules() -> dict[str, types.ModuleType]:
    cupy = types.ModuleType("cupy")
    for name in (
        "ndarray", "empty", "zeros", "ones", "full", "arange", "asarray",
        "ascontiguousarray", "asnumpy", "__version__", "empty_like", "cos", "sin", "random",
        "get_default_memory_pool",
    ):  # fmt: skip
        setattr(cupy, name, getattr(device, name))
    cupy.RawModule = RawModule  # type: ignore[attr-defined]
    cupy.RawKernel = RawKernel  # type: ignore[attr-defined]
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream = device.Stream  # type: ignore[attr-defined]
    cuda.get_current_stream = device.get_current_stream  # type: ignore[attr-defined]
    cuda.alloc_pinned_memory = device.alloc_pinned_memory  # type: ignore[attr-defined]
    cuda.Event = device.Event  # type: ignore[attr-defined]
    cuda.get_elapsed_time = device.get_elapsed_time  # type: ignore[attr-defined]
    cuda.Device = lambda index=0: types.SimpleNamespace(id=index)  # type: ignore[attr-defined]
    cuda.runtime = types.SimpleNamespace(  # type: ignore[attr-defined]
        getDeviceCount=lambda: 1,
        memGetInfo=lambda: (
            device.STATE.free_bytes - device.STATE.allocated_bytes - device.STATE.pooled_bytes,
            device.STATE.free_bytes,
        ),
        runtimeGetVersion=lambda: 13000,
        # An H100's: its SM count sizes decode attention's grid and the workspace; the
        # benchmarks read its peak bandwidth from the memory clock (kHz) and bus (bits).
        getDeviceProperties=lambda index: {
            "name": b"CuPy stand-in (CPU)",
            "multiProcessorCount": 132,
            "memoryClockRate": 2619000,
            "memoryBusWidth": 5120,
        },
    )
    cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 1)  # type: ignore[attr-defined]
    cuda.cublas = _refusing_cupy_cublas()  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    nvmath = types.ModuleType("nvmath")
    bindings = types.ModuleType("nvmath.bindings")
    bindings.cublas = cublas  # type: ignore[attr-defined]
    nvmath.bindings = bindings  # type: ignore[attr-defined]
    return {
        "cupy": cupy,
        "cupy.cuda": cuda,
        "cupy.cuda.cublas": cuda.cublas,  # type: ignore[attr-defined]
        "nvmath": nvmath,
        "nvmath.bindings": bindings,
        "nvmath.bindings.cublas": cublas,  # type: ignore[dict-item]
    }


def _forget_backend() -> None:
    for name in [n for n in sys.modules if n.startswith(BACKEND_PACKAGE)]:
        del sys.modules[name]


@contextlib.contextmanager
def installed(free_bytes: int = 80 << 30) -> Iterator[device.DeviceState]:
    """The stand-in in sys.modules and the cupy backend imported against it; both undone on
    exit. Yields the device state: allocations, launches, captures."""
    fakes = _modules()
    saved = {name: sys.modules.get(name) for name in fakes}
    _forget_backend()
    sys.modules.update(fakes)
    device.STATE.reset(free_bytes)
    cublas.reset()
    try:
        yield device.STATE
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        _forget_backend()
