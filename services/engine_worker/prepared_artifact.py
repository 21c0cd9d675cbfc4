"""Prepared artifacts: a model's packed weights and compiled step, stored under a key that says
which machines and runtimes may load them.

Layout: `<root>/<id>/manifest.json` beside the files it lists with their sha256. The id is the
first 16 hex digits of the key's digest; the key names the source artifact's digest, the
kvmesh, torch, Python and C++ compiler versions, the step's own source files, the CPU's
instruction set, and the formats the worker runs (backend, weights, activations, KV dtype,
block size, compiled or not). The step limits are left out: the manifest says which it serves
(`step_limits_mismatch`). A directory is written under a temporary name and renamed, and
a lock per id makes workers racing on one key prepare it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from shared.config import SchedulerConfig
from shared.errors import ModelValidationError
from shared.model_entry import sha256_file

MANIFEST = "manifest.json"
FORMAT = 1  # this layout; a change makes every older artifact a mismatch
# The code a compiled program was traced from: a change there is a new key.
_STEP_SOURCES = (
    "torch_backend/compiled_model.py",
    "torch_backend/graph_ops.py",
    "torch_backend/graph_projections.py",
    "torch_backend/dot_kernels.py",
    "torch_backend/int4_dot.py",
    "torch_backend/int8_dot.py",
    "torch_backend/csrc/int4_dot.cpp",
    "torch_backend/csrc/int8_dot.cpp",
    "torch_backend/graph_batch.py",
    "torch_backend/attention.py",
    "torch_backend/prefill_attention.py",
    "torch_backend/linear.py",
    "torch_backend/weights.py",
    "torch_backend/packed_state.py",
    "torch_backend/saved_programs.py",
)


@dataclass(frozen=True)
class PreparedKey:
    source: str  # the model artifact's digest
    kvmesh: str
    step_code: str  # digest of _STEP_SOURCES
    torch: str
    python: str
    compiler: str
    cpu: str  # architecture, torch's CPU capability, bfloat16, VNNI and AMX support
    backend: str
    weights: str
    activations: str
    kv_cache: str
    block_size: int
    compiled: bool
    format: int = FORMAT

    @property
    def id(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: dict[str, Any]) -> list[str]:
        """What `other` (a stored key) says that this one does not, as 'field: theirs != ours'."""
        return [
            f"{f.name}: {other.get(f.name)!r} != {getattr(self, f.name)!r}"
            for f in fields(self)
            if other.get(f.name) != getattr(self, f.name)
        ]


def runtime_key_parts() -> dict[str, str]:
    """The parts of a key this machine and runtime decide."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        kvmesh = version("kvmesh")
    except PackageNotFoundError:
        kvmesh = "unknown"
    return {
        "kvmesh": kvmesh,
        "step_code": _step_code_digest(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "compiler": _compiler_version(),
        "cpu": cpu_features(),
    }


def cpu_features() -> str:
    flags = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    if torch.cpu._is_avx512_bf16_supported():
        flags.append("avx512_bf16")
    if torch.cpu._is_vnni_supported():
        flags.append("vnni")
    if torch.cpu._is_amx_tile_supported():
        flags.append("amx")
    return " ".join(flags)


@functools.cache
def _step_code_digest() -> str:
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for relative in _STEP_SOURCES:
        digest.update((root / relative).read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _compiler_version() -> str:
    """The first line of `c++ --version`: the compiler Inductor builds with (CXX if set)."""
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    return done.stdout.splitlines()[0] if done.stdout else "none"


def step_limits_of(limits: SchedulerConfig) -> dict[str, int]:
    """The limits on one step's size that an artifact records, and a worker's must meet."""
    return {
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "max_num_seqs": limits.max_num_seqs,
        "max_sampled_rows": limits.max_sampled_rows,
    }


@dataclass(frozen=True)
class PreparedArtifact:
    directory: Path
    manifest: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.manifest["id"])

    def step_limits_mismatch(self, step_limits: dict[str, int]) -> str:
        """Why it may not serve a worker with these step limits ('step_limits: theirs !=
        ours'); "" when it may: export proved that its programs take any size, or it was
        prepared under the same limits. Its key leaves them out: then one artifact serves
        every engine of the model."""
        prepared_for = self.manifest.get("step_limits")
        if self.manifest.get("programs_take_any_size") or prepared_for == step_limits:
            return ""
        return f"step_limits: {prepared_for!r} != {step_limits!r} (programs fixed to its sizes)"

    def verify(self) -> None:
        """Every listed file present with its digest: a corrupt artifact is never loaded."""
        files = sorted(self.manifest["files"].items())

        def digest(name: str) -> str:
            path = self.directory / name
            return sha256_file(str(path)) if path.is_file() else "missing"

        # hashlib lets go of the GIL: the files hash side by side (0.14 s -> 0.08 on 2 cores)
        with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
            digests = list(pool.map(digest, [name for name, _ in files]))
        for (name, expected), found in zip(files, digests, strict=True):
            path = self.directory / name
            if found != expected:
                raise ModelValidationError(
                    str(path),
                    f"prepared artifact {self.id}: {name} does not match its digest (corrupt "
                    "or replaced); delete the folder or run `kvmesh prepare` again",
                    expected=expected,
                    found=found,
                )


@dataclass(frozen=True)
class Lookup:
    artifact: PreparedArtifact | None
    mismatch: str  # why a stored artifact of this source was not used; "" if none was found


class PreparedStore:
    """Prepared artifacts under `roots`, searched in order; new ones go to the first writable."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots

    def lookup(self, key: PreparedKey, step_limits: dict[str, int]) -> Lookup:
        """The artifact stored under this key that serves these step limits; else why one of
        the same source (its id's first) was not used."""
        mismatches: list[str] = []
        for root in self.roots:
            for folder in sorted(path.parent for path in root.glob(f"*/{MANIFEST}")):
                stored = _read_manifest(folder) or {}
                differences = key.differences(stored.get("key", {}))
                if folder.name == key.id and not differences:
                    found = PreparedArtifact(folder, stored)
                    if not (why := found.step_limits_mismatch(step_limits)):
                        return Lookup(found, "")
                    differences = [why]
                reason = f"{folder.name}: " + "; ".join(differences)
                if folder.name == key.id:
                    mismatches.insert(0, reason)
                elif stored.get("key", {}).get("source") == key.source:
                    mismatches.append(reason)
        return Lookup(None, mismatches[0] if mismatches else "")

    def writable_root(self) -> Path:
        for root in self.roots:
            with contextlib.suppress(OSError):
                root.mkdir(parents=True, exist_ok=True)
            if os.access(root, os.W_OK):
                return root
        raise OSError(f"no writable folder for prepared artifacts among {self.roots}")

    @contextlib.contextmanager
    def locked(self, key: PreparedKey) -> Iterator[float]:
        """This key's lock held (waiting for another worker preparing it); yields the wait."""
        locks = self.writable_root() / ".locks"
        locks.mkdir(exist_ok=True)
        with open(locks / f"{key.id}.lock", "w") as lock:
            started = time.perf_counter()
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield time.perf_counter() - started

    def begin(self, key: PreparedKey) -> Path:
        """A fresh temporary folder to fill, on the same file system as the final one. Called
        with the key's lock held: any other staging folder of this key is a killed start's."""
        root = self.writable_root()
        for stale in root.glob(f".{key.id}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = root / f".{key.id}.{os.getpid()}.tmp"
        staging.mkdir()
        return staging

    def commit(
        self, key: PreparedKey, staging: Path, files: list[str], extra: dict[str, Any]
    ) -> PreparedArtifact:
        """Digests recorded, the manifest written last, the folder renamed into place (an older
        one of the same id, a mismatch or corrupt, is replaced)."""
        manifest = {
            "id": key.id,
            "key": asdict(key),
            "files": {name: sha256_file(str(staging / name)) for name in files},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **extra,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        final = staging.parent / key.id
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        return PreparedArtifact(final, manifest)


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
