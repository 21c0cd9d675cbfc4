"""Compute backends by name, imported lazily so a machine pays only for the one it runs.

Each module provides `Runner(arch, weights, kv_shape, max_model_len, dtype, config)` with
`step(scheduled, rng) -> (states that sampled, their tokens)` and `kv_cache_bytes`.
"""

from __future__ import annotations

from services.engine_worker.artifacts.architecture import ModelArchitecture
from shared.errors import KvmeshError, ModelValidationError, Reason

# name -> module providing `Runner`; torch is the reference implementation (CPU).
BACKENDS = {
    "torch": "services.engine_worker.torch_backend.runner",
    # CUDA C kernels through CuPy, cuBLAS GEMMs
    "cupy": "services.engine_worker.cupy_backend.runner",
}


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
    """`resolve_backend`'s, where it runs the model: only the torch backend runs a layer other
    than Llama's (Gemma's, a partial rotary, LongRoPE), refused by name before anything is
    allocated."""
    backend = resolve_backend(name)
    if backend != "torch" and not arch.llama_layer:
        raise ModelValidationError(
            path,
            f"{arch.name} runs on the torch backend only",
            expected="--backend torch",
            found=backend,
        )
    return backend
