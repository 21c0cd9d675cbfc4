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

    @property
    def artifact_digest(self) -> str:
        """One digest for the whole artifact: sha256 over each file's digest, in path order."""
        combined = hashlib.sha256()
        for path in sorted(self.artifact_sha256):
            combined.update(bytes.fromhex(self.artifact_sha256[path]))
        return combined.hexdigest()

    @property
    def version(self) -> str:
        return self.artifact_digest[:12]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "artifact_digest": self.artifact_digest, "version": self.version}
