"""TorchInductor's compiled code under kvmesh's cache folder, shared by the workers of a machine.

Inductor keeps what it compiles in TORCHINDUCTOR_CACHE_DIR, by default under the system's
temporary folder: gone after a reboot and absent from every new container or pod, so each of
them paid the cold compile (the default model's warm-up on a 2-core machine: 147.5 s cold,
18.4 s from the cache). kvmesh points it at `$KVMESH_CACHE_DIR/inductor/<CPU capability>`
(default `~/.cache/kvmesh`) unless TORCHINDUCTOR_CACHE_DIR is set, and a worker warming up a
compiled model holds an exclusive lock per model and format meanwhile: a second worker started
beside it waits, then loads what the first compiled instead of compiling it again. Inductor's
counters say how many graphs came from the cache; the manifest records them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvmesh.engine_worker.compile_cache")


def cache_root() -> Path:
    """kvmesh's cache folder: KVMESH_CACHE_DIR, else ~/.cache/kvmesh."""
    configured = os.environ.get("KVMESH_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "kvmesh"


@dataclass
class CompileCacheUse:
    """What one warm-up took from the cache, for the manifest."""

    directory: str
    hits: int = 0  # compiled graphs loaded from the cache
    misses: int = 0  # graphs compiled (and stored)
    lock_wait_seconds: float = 0.0  # waiting for another worker compiling the same key

    def to_dict(self) -> dict[str, object]:
        return {
            "directory": self.directory,
            "hits": self.hits,
            "misses": self.misses,
            "lock_wait_seconds": round(self.lock_wait_seconds, 3),
        }


def point_inductor_at_our_folder() -> Path:
    """TORCHINDUCTOR_CACHE_DIR as the user set it, else kvmesh's folder. Inductor writes its
    default into the variable the first time it looks (loading a model probes the C++
    compiler), so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        current = str(inductor_folder())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = current
    return Path(current)


def inductor_folder() -> Path:
    """kvmesh's Inductor folder, one per CPU capability torch runs with: Inductor's cache keys
    leave it out, and a run as AVX2 (ATEN_CPU_CAPABILITY=avx2) on an AVX-512 machine crashed
    in graphs an AVX-512 run had cached."""
    import torch

    return cache_root() / "inductor" / torch.backends.cpu.get_cpu_capability().lower()


def _graph_counts() -> tuple[int, int]:
    """Graphs Inductor loaded from its cache (also those AOTAutograd's cache finds: it loads
    their code from Inductor's) and graphs it compiled."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]


@contextlib.contextmanager
def compiling(key_parts: tuple[str, ...]) -> Iterator[CompileCacheUse]:
    """Around the first steps of a compiled model: the cache folder set, this key's lock held
    (several workers of one model on a machine compile it once), hits and misses counted."""
    directory = point_inductor_at_our_folder()
    locks = directory / "kvmesh-locks"
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:16]
    use = CompileCacheUse(str(directory))
    with open(locks / f"{key}.lock", "w") as lock:
        waiting = time.perf_counter()
        fcntl.flock(lock, fcntl.LOCK_EX)
        use.lock_wait_seconds = time.perf_counter() - waiting
        hits, misses = _graph_counts()
        try:
            yield use
        finally:  # the lock goes with the file
            now_hits, now_misses = _graph_counts()
            use.hits, use.misses = now_hits - hits, now_misses - misses


def warm_up_cached(
    warm_up: Callable[[], None], runner: object, key_parts: tuple[str, ...]
) -> dict[str, object] | None:
    """`warm_up()`, under `compiling` when the runner has a compiled step; what it took from
    the cache, for the manifest (None: nothing compiles)."""
    if getattr(runner, "compiled", None) is None:
        warm_up()
        return None
    with compiling(key_parts) as use:
        warm_up()
    message = "warm-up compiled the step" if use.misses else "warm-up loaded the compiled step"
    log.info(message, extra=use.to_dict())
    return use.to_dict()
