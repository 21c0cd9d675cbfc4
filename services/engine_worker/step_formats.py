"""How a worker's step runs, resolved once from its config, the artifact and this machine: the
activation dtype, the weights' format, whether the step is one compiled graph, and the KV
pool's element type. The worker sizes its memory from these and hands them to its runner."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass

import torch

from services.engine_worker.kv_cache import kv_cache_dtype
from services.engine_worker.torch_backend.weights import resolve_weight_format
from shared.config import EngineConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def has_cpp_compiler() -> bool:
    """Inductor builds its kernels with a C++ compiler at run time (a slim image has none):
    CXX, else g++, as Inductor looks for it (without importing Inductor, ~1 s)."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def compiler_available() -> bool:
    """Whether the step can compile here; without a C++ compiler it runs eager, with a
    warning."""
    if has_cpp_compiler():
        return True
    log.warning("no C++ compiler (g++) for the compiled step: the model runs eager")
    return False


@dataclass(frozen=True)
class StepFormats:
    activations: torch.dtype
    weights: str  # packed | float32 | bfloat16 | float16 (weights.WEIGHT_FORMATS)
    compiled: bool  # a packed model on the CPU, where inductor has a C++ compiler
    kv_cache: torch.dtype

    @staticmethod
    def resolve(
        config: EngineConfig, backend: str, quantization: str, compilable: bool = True
    ) -> StepFormats:
        """`quantization`: the artifact's tensor types, e.g. "F32+Q4_1+Q8_0"; `compilable`:
        whether the compiled step is written for the model's layer (ModelArchitecture.
        llama_layer)."""
        activations = DTYPES[config.dtype]
        weights = resolve_weight_format(config.weights, config.quantize, quantization)
        if backend != "torch" or os.environ.get("KVMESH_TORCH_DEVICE", "cpu") != "cpu":
            weights = config.dtype  # packed weights are CPU kernels' formats
        compiled = (
            weights == "packed" and compilable and config.compile == "auto" and compiler_available()
        )
        requested = None if config.cache.dtype == "auto" else DTYPES[config.cache.dtype]
        return StepFormats(
            activations, weights, compiled, kv_cache_dtype(requested, activations, compiled)
        )

    @property
    def load_dtype(self) -> torch.dtype:
        """What the weights are read into: packed formats are built from a float32 copy."""
        return torch.float32 if self.weights == "packed" else self.activations

    def runner_config(self, config: EngineConfig) -> EngineConfig:
        """`config` with every choice resolved: what the runner builds from."""
        return dataclasses.replace(
            config,
            weights=self.weights,
            compile="auto" if self.compiled else "off",
            cache=dataclasses.replace(config.cache, dtype=dtype_name(self.kv_cache)),
        )
