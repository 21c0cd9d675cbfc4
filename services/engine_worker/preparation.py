"""How a worker gets its runner ready: from a prepared artifact that matches it, else by preparing
the model (dequantize, pack, compile, warm up) and storing the result for the next start.

A matching artifact is verified (every file's digest), its weights mapped and its compiled step
loaded: no dequantization, packing or tracing. Its recorded greedy tokens are reproduced before
it serves. An artifact whose key differs (another torch, CPU, format...) is not used: the log and
the manifest say which part differs, and the model is prepared anew. A corrupt one is refused
(INVALID_MODEL): the worker does not start, so a rollout keeps its previous version serving.
"""

from __future__ import annotations

import importlib
import logging
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from services.engine_worker import preparing
from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.loader import ModelArtifact
from services.engine_worker.artifacts.weights import ModelWeights
from services.engine_worker.backends import BACKENDS
from services.engine_worker.background_preparation import ChildPreparation, load_programs
from services.engine_worker.compile_cache import cache_root, warm_up_cached
from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.preparation_underway import EAGER_WHILE_COMPILING
from services.engine_worker.prepared_artifact import (
    PreparedArtifact,
    PreparedKey,
    PreparedStore,
    runtime_key_parts,
    step_limits_of,
)
from services.engine_worker.step_formats import StepFormats, dtype_name
from services.engine_worker.torch_backend.weights import int4_source
from shared.config import EngineConfig
from shared.errors import ModelValidationError
from shared.model_entry import ModelEntry


class Worker(Protocol):
    """What preparing a runner reads of the worker, and the runner it sets for warm-up."""

    config: EngineConfig
    backend: str
    entry: ModelEntry | None
    model_path: str
    architecture: ModelArchitecture
    kv_shape: KVCacheShape
    max_model_len: int
    runner: Any

    def warm_up(self) -> None: ...

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]: ...


log = logging.getLogger("kvmesh.engine_worker.preparation")


@dataclass
class Preparation:
    """What the manifest says of how this runner was made ready."""

    # loaded (a prepared artifact) | prepared (and stored) | preparing (serving on the eager
    # step, its compiled programs compiling; `prepared` once they serve, `failed` if they
    # never will: the eager step serves on) | off
    source: str = "off"
    id: str = ""
    directory: str = ""
    mismatch: str = ""  # a stored artifact of this model that was not used, and why
    lock_wait_seconds: float = 0.0
    # seconds: load (read the source, or map a prepared artifact), prepare (pack the weights),
    # compile (trace and compile the step), warmup (first steps and fixtures)
    phases: dict[str, float] = field(default_factory=dict)
    compile_cache: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        found = asdict(self)
        found["phases"] = {k: round(v, 3) for k, v in self.phases.items()}
        return found


def prepared_key(worker: Worker, formats: StepFormats, source_digest: str) -> PreparedKey:
    config, runtime = worker.config, runtime_key_parts()
    return PreparedKey(
        source=source_digest,
        kvmesh=runtime["kvmesh"],
        step_code=runtime["step_code"],
        torch=runtime["torch"],
        python=runtime["python"],
        compiler=runtime["compiler"],
        cpu=runtime["cpu"],
        backend=worker.backend,
        weights=formats.weights,
        activations=dtype_name(formats.activations),
        kv_cache=dtype_name(formats.kv_cache),
        block_size=config.cache.block_size,
        compiled=config.compile == "auto",
    )


def store_for(worker: Worker) -> PreparedStore:
    """--prepared-dir first, then the repository version's own `prepared/`, then the cache."""
    roots = [Path(worker.config.prepared_dir)] if worker.config.prepared_dir else []
    if worker.entry is not None:
        roots.append(Path(worker.entry.directory) / "prepared")
    return PreparedStore([*roots, cache_root() / "prepared"])


def ready_runner(
    worker: Worker,
    artifact: ModelArtifact,
    formats: StepFormats,
    source_digest: str,
    background: bool = False,
) -> tuple[Any, int, Preparation, ChildPreparation | None]:
    """The runner, loaded and warmed up; the weights' parameter count; how it was made; and,
    with `background` (a served worker, `--prepared auto`) and no artifact stored yet, the
    child preparing it, for the caller to `finish_pending` between two steps."""
    if not _preparable(worker, formats):
        return (*_from_source(worker, artifact, formats, Preparation()), None)
    key = prepared_key(worker, formats, source_digest)
    store, limits = store_for(worker), step_limits_of(worker.config.scheduler)
    found, waited = store.lookup(key, limits), 0.0
    if found.artifact is None and background and worker.config.prepared == "auto":
        return _in_background(worker, artifact, formats, key, store, found.mismatch)
    if found.artifact is None:
        with ExitStack() as held:
            waited = held.enter_context(store.locked(key))  # another worker may be preparing
            found = store.lookup(key, limits)  # what it stored while this one waited
            if found.artifact is None:
                _say_preparing(found.mismatch)
                preparation = Preparation("prepared", key.id, mismatch=found.mismatch)
                preparation.lock_wait_seconds = waited
                runner, num_parameters = _build(worker, artifact, formats, preparation)
                started = preparing.start(
                    runner, num_parameters, key, store, held.pop_all(), limits
                )
                try:
                    _warm_up(worker, runner, formats, preparation)
                except BaseException:
                    preparing.release(started)
                    raise
                directory = preparing.finish(started, worker.greedy, preparation.phases)
                preparation.directory = str(directory)
                log.info("model prepared and stored", extra=preparation.to_dict())
                return runner, num_parameters, preparation, None
    preparation = Preparation("loaded", key.id, str(found.artifact.directory))
    preparation.lock_wait_seconds = waited
    return (*_from_prepared(worker, found.artifact, formats, preparation), None)


def _say_preparing(mismatch: str) -> None:
    if mismatch:
        log.warning(
            "prepared artifact not used: it was made for another runtime or other step "
            "limits; preparing anew",
            extra={"mismatch": mismatch},
        )
    # Said first: the launcher shows it while a first start waits (minutes).
    log.info("preparing the model for this machine, once; later starts load it")


def _in_background(
    worker: Worker,
    artifact: ModelArtifact,
    formats: StepFormats,
    key: PreparedKey,
    store: PreparedStore,
    mismatch: str,
) -> tuple[Any, int, Preparation, ChildPreparation]:
    """The child started first (both pack at once), then this worker's own runner, its step
    run eagerly until the child's programs are loaded."""
    _say_preparing(mismatch)
    child = ChildPreparation(worker.config, key, store)
    # A core left to the child: a torch pool whose threads lose their core to another process
    # stalls at every barrier (a 54-token answer took 30 s on 2 cores with both threads).
    child.serving_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, child.serving_threads - 1))
    try:
        preparation = Preparation("preparing", key.id, mismatch=mismatch)
        runner, num_parameters = _build(worker, artifact, formats, preparation)
        if runner.compiled is not None:
            runner.compiled.programs.eager_fallback = True
        _warm_up(worker, runner, formats, preparation)
    except BaseException:
        child.stop()
        torch.set_num_threads(child.serving_threads)
        raise
    log.info(EAGER_WHILE_COMPILING)
    return runner, num_parameters, preparation, child


def _preparable(worker: Worker, formats: StepFormats) -> bool:
    config = worker.config
    return config.prepared != "off" and worker.backend == "torch" and formats.weights == "packed"


def _from_source(
    worker: Worker, artifact: ModelArtifact, formats: StepFormats, preparation: Preparation
) -> tuple[Any, int, Preparation]:
    runner, num_parameters = _build(worker, artifact, formats, preparation)
    _warm_up(worker, runner, formats, preparation)
    return runner, num_parameters, preparation


def _build(
    worker: Worker, artifact: ModelArtifact, formats: StepFormats, preparation: Preparation
) -> tuple[Any, int]:
    """The runner from the source artifact (load: dequantized; prepare: packed). The float
    weights go when this returns: the runner holds its own."""
    if worker.backend == "sim":  # the serving path under test: no weights read
        preparation.phases = {"load": 0.0, "prepare": 0.0}
        return _runner(worker, formats, None), 0
    started = time.perf_counter()
    weights = ModelWeights.build(worker.architecture, artifact.load, formats.load_dtype)
    loaded = time.perf_counter()
    packed = formats.weights == "packed"  # torch only: a Q4 file's 4-bit groups if fast
    int4 = {"int4": int4_source(artifact, worker.config.quantize)} if packed else {}
    runner = _runner(worker, formats, weights, **int4)
    preparation.phases = {"load": loaded - started, "prepare": time.perf_counter() - loaded}
    return runner, weights.num_parameters


def _runner(worker: Worker, formats: StepFormats, weights: object, **extra: Any) -> Any:
    return importlib.import_module(BACKENDS[worker.backend]).Runner(
        worker.architecture,
        weights,
        worker.kv_shape,
        worker.max_model_len,
        formats.activations,
        formats.runner_config(worker.config),
        **extra,
    )


def _warm_up(worker: Worker, runner: Any, formats: StepFormats, preparation: Preparation) -> None:
    """Warm-up under the compile cache; the compile phase is what exporting programs took
    within it."""
    worker.runner = runner
    step = getattr(runner, "compiled", None)
    compiled_before = step.programs.compile_seconds if step is not None else 0.0
    started = time.perf_counter()
    key = (worker.model_path, formats.weights, str(formats.activations), str(formats.kv_cache))
    preparation.compile_cache = warm_up_cached(worker.warm_up, runner, key)
    compiled = (step.programs.compile_seconds if step is not None else 0.0) - compiled_before
    preparation.phases["compile"] = compiled
    preparation.phases["warmup"] = time.perf_counter() - started - compiled


def _from_prepared(
    worker: Worker, stored: PreparedArtifact, formats: StepFormats, preparation: Preparation
) -> tuple[Any, int, Preparation]:
    from services.engine_worker.torch_backend.packed_state import load_packed

    started = time.perf_counter()
    stored.verify()
    weights = load_packed(str(stored.directory), worker.architecture.num_layers)
    runner = _runner(worker, formats, weights)
    manifest = stored.manifest
    if runner.compiled is not None:
        load_programs(runner.compiled, stored)
    loaded = time.perf_counter()
    worker.runner = runner
    # Its fixture is its warm-up: a prefill step, then decode steps, through both programs
    # (each prefill step costs its GEMMs' fixed 256-row pieces: ~0.35 s on 2 cores).
    fixture = manifest["fixture"]
    found = worker.greedy(list(fixture["prompt_ids"]), len(fixture["expected_ids"]))
    preparation.phases = {
        "load": loaded - started,
        "prepare": 0.0,
        "compile": 0.0,
        "warmup": time.perf_counter() - loaded,
    }
    if found != fixture["expected_ids"]:
        raise ModelValidationError(
            str(stored.directory),
            f"prepared artifact {stored.id}: its fixture's greedy tokens differ from those "
            "recorded when it was prepared; delete the folder or run `kvmesh prepare` again",
            expected=fixture["expected_ids"],
            found=found,
        )
    log.info("prepared model loaded", extra=preparation.to_dict())
    return runner, int(manifest["num_parameters"]), preparation
