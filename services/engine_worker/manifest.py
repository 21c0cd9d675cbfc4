"""The manifest of a loaded model: what runs, from which bytes, with how much cache."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.loader import artifact_files
from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.runtime_facts import device_name, runtime_versions, tokenizer_digest
from services.engine_worker.step_formats import StepFormats, dtype_name
from shared.config import EngineConfig
from shared.model_entry import ModelEntry, sha256_file
from shared.sliding_window import WindowPool

if TYPE_CHECKING:
    from services.engine_worker.step_runner import StepRunner


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
    # the largest step its buffers were sized for: tokens and sampled rows
    max_step_tokens: int = 0
    max_step_sampled_rows: int = 0
    # sliding layers that keep their window only: the window, and the window blocks the
    # scheduler counts (0, 0: every layer keeps the whole context)
    sliding_window: int = 0
    kv_window_blocks: int = 0
    # cupy: decode batch size -> "graph", or why its capture failed (it runs eagerly)
    cuda_graphs: dict[str, str] | None = None
    # a compiled step: the Inductor cache folder, graphs loaded from it and compiled (hits,
    # misses), and the wait for another worker compiling the same model (compile_cache.py)
    compile_cache: dict[str, Any] | None = None
    # how the runner was made ready: loaded from a prepared artifact (its id and folder),
    # prepared (and stored), or off; a stored artifact not used and why; seconds per phase
    preparation: dict[str, Any] | None = None

    @property
    def artifact_digest(self) -> str:
        return combined_digest(self.artifact_sha256)

    @property
    def prepared_id(self) -> str:
        return str((self.preparation or {}).get("id", ""))

    @property
    def version(self) -> str:
        """The repository's version name, else the first 12 hex digits of the digest."""
        return self.repository_version or self.artifact_digest[:12]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "artifact_digest": self.artifact_digest, "version": self.version}


def describe(
    config: EngineConfig,
    entry: ModelEntry | None,
    model_path: str,
    arch: ModelArchitecture,
    runner: StepRunner,
    formats: StepFormats,
    *,
    backend: str,
    max_model_len: int,
    kv_shape: KVCacheShape,
    quantization: str,
    num_parameters: int,
    digests: dict[str, str],
    load_seconds: float,
    warmup_seconds: float,
    preparation: dict[str, Any],
    window_pool: WindowPool | None = None,
) -> ModelManifest:
    """The manifest of a model a worker has loaded and warmed."""
    return ModelManifest(
        model_name=entry.name if entry else os.path.basename(model_path.rstrip("/")),
        artifact_path=model_path,
        artifact_sha256=digests,
        architecture=arch.name,
        num_parameters=num_parameters,
        dtype=config.dtype,
        quantization=quantization,
        weights=formats.weights,
        weights_resident_bytes=runner.weights_resident_bytes,
        compiled=getattr(runner, "compiled", None) is not None,
        cuda_graphs=getattr(runner, "cuda_graphs", None),
        max_step_tokens=config.scheduler.max_num_batched_tokens,
        max_step_sampled_rows=config.scheduler.max_sampled_rows,
        compile_cache=preparation.get("compile_cache"),
        preparation=preparation,
        backend=backend,
        max_model_len=max_model_len,
        kv_cache_dtype=dtype_name(formats.kv_cache),
        kv_bytes_per_token=arch.kv_bytes_per_token(formats.kv_cache.itemsize),
        kv_block_size=kv_shape.block_size,
        kv_blocks=kv_shape.num_blocks,
        sliding_window=window_pool.window if window_pool else 0,
        kv_window_blocks=window_pool.num_blocks if window_pool else 0,
        kv_cache_bytes=runner.kv_cache_bytes,
        load_seconds=round(load_seconds, 3),
        warmup_seconds=round(warmup_seconds, 3),
        repository_version=entry.version if entry else "",
        aliases=entry.aliases if entry else (),
        default_sampling=dict(entry.default_sampling) if entry else None,
        runtime=runtime_versions(backend),
        device=device_name(backend),
        threads=torch.get_num_threads(),
        tokenizer_digest=tokenizer_digest(digests),
    )


def combined_digest(digests: dict[str, str]) -> str:
    """One digest for the whole artifact: sha256 over each file's digest, in path order."""
    combined = hashlib.sha256()
    for path in sorted(digests):
        combined.update(bytes.fromhex(digests[path]))
    return combined.hexdigest()


def artifact_digests(entry: ModelEntry | None, model_path: str) -> dict[str, str]:
    if entry is not None:  # verified a moment ago: no second pass over the bytes
        return {os.path.join(entry.directory, f): d for f, d in entry.sha256.items()}
    return {f: sha256_file(f) for f in artifact_files(model_path)}
