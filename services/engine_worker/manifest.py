"""The manifest of a loaded model: what runs, from which bytes, with how much cache."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelManifest:
    model_name: str
    artifact_path: str
    artifact_sha256: dict[str, str]  # file -> digest
    architecture: str
    num_parameters: int
    dtype: str
    quantization: str  # the artifact's tensor types, as stored
    backend: str
    max_model_len: int
    kv_bytes_per_token: int
    kv_block_size: int
    kv_blocks: int
    kv_cache_bytes: int
    load_seconds: float
    warmup_seconds: float
    weights: str = "float32"  # the format the weights run in: packed | float32 | bfloat16
    weights_resident_bytes: int = 0  # what the weights keep in memory in that format
    compiled: bool = False  # steps run as one TorchInductor graph (compiled_model.py)
    kv_cache_dtype: str = "float32"  # the KV pool's elements (kv_cache.kv_cache_dtype)
    repository_version: str = ""  # the repository entry's version; "" when loaded from a path
    aliases: tuple[str, ...] = ()
    default_sampling: dict[str, Any] | None = None  # the entry's [sampling] table
    runtime: dict[str, str] | None = None  # software versions (kvmesh, torch, llguidance...)
    device: str = ""
    threads: int = 0  # torch intra-op threads
    tokenizer_digest: str = ""

    @property
    def artifact_digest(self) -> str:
        """One digest for the whole artifact: sha256 over each file's digest, in path order."""
        combined = hashlib.sha256()
        for path in sorted(self.artifact_sha256):
            combined.update(bytes.fromhex(self.artifact_sha256[path]))
        return combined.hexdigest()

    @property
    def version(self) -> str:
        """The repository's version name, else the first 12 hex digits of the digest."""
        return self.repository_version or self.artifact_digest[:12]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "artifact_digest": self.artifact_digest, "version": self.version}
