"""Finding and opening model artifacts: a GGUF file, an HF directory, or the default model."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.int4_groups import Int4Groups
from shared.errors import ModelValidationError


class ModelArtifact(Protocol):
    """A validated source of HF-layout tensors."""

    path: str
    architecture: ModelArchitecture

    @property
    def quantization(self) -> str: ...

    def validate(self) -> None: ...

    def load(self, name: str) -> torch.Tensor: ...

    def load_int4(self, name: str) -> Int4Groups | None: ...


def open_artifact(path: str) -> ModelArtifact:
    if os.path.isdir(path):
        from services.engine_worker.artifacts.hf_checkpoint import HFArtifact

        return HFArtifact(path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelValidationError(
            path, "not a GGUF file or an HF model directory", expected="magic b'GGUF'", found=magic
        )
    from services.engine_worker.artifacts.gguf_file import GGUFArtifact

    return GGUFArtifact(path)


def artifact_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(
        os.path.join(path, name)
        for name in os.listdir(path)
        if name.endswith((".safetensors", ".json", ".gguf"))
    )
