"""What a result depends on besides the weights and the request: software versions, the
device, the thread count and the tokenizer. They go into the manifest and from there into
every request's execution record, so drift between two runs can be explained."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform

import torch

# Files that define a Hugging Face tokenizer (a GGUF carries its tokenizer inside itself).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def runtime_versions(backend: str) -> dict[str, str]:
    versions = {
        "kvmesh": _version("kvmesh"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "llguidance": _version("llguidance"),
    }
    if backend == "cupy":
        import cupy

        versions["cupy"] = cupy.__version__
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        versions["cuda"] = f"{runtime // 1000}.{runtime % 1000 // 10}"
    elif torch.version.cuda and torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
    return versions


def device_name(backend: str) -> str:
    if backend == "sim":
        return "simulated: no model computed"
    if backend == "cupy":
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    if os.environ.get("KVMESH_TORCH_DEVICE", "cpu") != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"


def tokenizer_digest(artifact_sha256: dict[str, str]) -> str:
    """sha256 over the digests of the files that define the tokenizer, in name order; a
    single-file artifact (GGUF) holds its tokenizer, so its own digest stands for it."""
    chosen = sorted(p for p in artifact_sha256 if os.path.basename(p) in TOKENIZER_FILES)
    if not chosen and len(artifact_sha256) == 1:
        chosen = list(artifact_sha256)
    if not chosen:
        return ""
    combined = hashlib.sha256()
    for path in chosen:
        combined.update(bytes.fromhex(artifact_sha256[path]))
    return combined.hexdigest()
