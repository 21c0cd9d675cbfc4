"""The manifest of a loaded model: what runs, from which bytes, with how much cache."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any


def sha256_file(path: str, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelManifest:
    model_name: str
    artifact_path: str
    artifact_sha256: dict[str, str]  # file -> digest
    architecture: str
    num_parameters: int
    dtype: str
    quantization: str
    backend: str
    max_model_len: int
    kv_bytes_per_token: int
    kv_block_size: int
    kv_blocks: int
    kv_cache_bytes: int
    load_seconds: float
    warmup_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
