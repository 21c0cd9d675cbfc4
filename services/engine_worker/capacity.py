"""Whether an allocation fits the memory left on this machine's device, asked before making it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from services.engine_worker.backends import runner_class
from shared.config import EngineConfig
from shared.errors import KvmeshError, Reason

if TYPE_CHECKING:
    from services.engine_worker.artifacts.architecture import ModelArchitecture
    from services.engine_worker.kv_cache import KVCacheShape
    from services.engine_worker.step_formats import StepFormats


def available_bytes(backend: str) -> int:
    """Free device memory for the cupy backend (or torch on a GPU); MemAvailable on the CPU."""
    if backend == "cupy":
        import cupy

        # Blocks CuPy's pool keeps after a model is dropped are free to the next one in this
        # process (a reload, a benchmark's next batch), though the driver counts them as used.
        pooled = cupy.get_default_memory_pool().free_bytes()
        return int(cupy.cuda.runtime.memGetInfo()[0]) + int(pooled)
    device = os.environ.get("KVMESH_TORCH_DEVICE", "cpu")
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # not Linux: nothing to ask


def check_memory_fits(parts: dict[str, int], backend: str) -> None:
    """Everything the model will hold at once, against what the device has free now: asked
    before the first allocation, so a model that cannot fit is refused, not half loaded."""
    needed = sum(parts.values())
    available = available_bytes(backend)
    if needed > available:
        listed = ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in parts.items())
        raise KvmeshError(
            Reason.MODEL_DOES_NOT_FIT,
            f"the model needs {needed / 2**20:.0f} MiB ({listed}) but "
            f"{available / 2**20:.0f} MiB are free on this machine: lower --kv-memory, "
            "--max-num-batched-tokens or the weights' precision, or serve it elsewhere",
        )


def check_worker_fits(
    arch: ModelArchitecture,
    formats: StepFormats,
    config: EngineConfig,
    kv_shape: KVCacheShape,
    backend: str,
    max_model_len: int,
) -> None:
    """Weights (packed ones come from a float32 copy, the peak), the KV budget and what a
    step needs besides: checked before any is allocated, not found short while others serve."""
    step = runner_class(backend).step_memory_bytes
    check_memory_fits(
        {
            "weights": arch.num_parameters * formats.load_dtype.itemsize,
            "KV cache": kv_shape.num_bytes(formats.kv_cache.itemsize),
            "step workspace": step(
                arch, formats.activations, formats.runner_config(config), max_model_len
            ),
        },
        backend,
    )


def served_context(config: EngineConfig, model_len: int) -> int:
    """--max-model-len, which may not exceed the model's own context; else the model's."""
    if (config.max_model_len or 0) > model_len:
        message = f"max_model_len {config.max_model_len} exceeds the model's context length"
        raise KvmeshError(Reason.INVALID_ARGUMENT, f"{message} {model_len}")
    return config.max_model_len or model_len
