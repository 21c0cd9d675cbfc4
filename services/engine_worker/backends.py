"""Compute backends by name, imported lazily so a machine pays only for the one it runs.

Each module provides a `Runner` class that holds to the contract in step_runner.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.engine_worker.artifacts.architecture import ModelArchitecture
from shared.errors import KvmeshError, ModelValidationError, Reason

if TYPE_CHECKING:
    from services.engine_worker.step_runner import RunnerClass

# name -> module providing `Runner`; torch is the reference implementation (CPU).
BACKENDS = {
    "torch": "services.engine_worker.torch_backend.runner",
    # CUDA C kernels through CuPy, cuBLAS GEMMs
    "cupy": "services.engine_worker.cupy_backend.runner",
    # no model computed: the serving path measured at a set step time; never chosen by auto
    "sim": "services.engine_worker.sim_backend.runner",
}


def runner_class(backend: str) -> RunnerClass:
    """A resolved backend's `Runner`, its module imported now."""
    runner: RunnerClass = importlib.import_module(BACKENDS[backend]).Runner
    return runner


def cuda_devices() -> int:
    """GPUs CuPy can see; 0 when CuPy is missing or the driver has none."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return 0


def resolve_backend(name: str) -> str:
    """'auto' takes cupy only when CuPy sees a GPU, else torch."""
    if name == "auto":
        return "cupy" if cuda_devices() > 0 else "torch"
    if name not in BACKENDS:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            f"unknown backend {name!r}; available: auto, {', '.join(sorted(BACKENDS))}",
        )
    if name == "cupy" and cuda_devices() == 0:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            "backend 'cupy' needs CuPy and an NVIDIA GPU; none is visible (use torch)",
        )
    return name


def backend_for_model(name: str, arch: ModelArchitecture, path: str) -> str:
    """`resolve_backend`'s, where it runs the model: the cupy backend runs Llama's layer and
    Gemma 3's; the rest (Gemma 2's soft-caps, a partial rotary, LongRoPE) only the torch
    backend, refused by name before anything is allocated."""
    backend = resolve_backend(name)
    if backend == "cupy" and not arch.cupy_layer:
        raise ModelValidationError(
            path,
            f"{arch.name} runs on the torch backend only",
            expected="--backend torch",
            found=backend,
        )
    return backend
