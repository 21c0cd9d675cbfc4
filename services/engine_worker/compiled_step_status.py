"""What a served worker says of its compiled step, from a first start on the eager step to the
switch to the stored programs or a failed preparation: gauges, a health service name of its
own, and the log lines `kvmesh up` reads (preparation_underway.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Gauge

from services.engine_worker.preparation_underway import COMPILED_SERVING, PREPARATION_FAILED
from shared.errors import ModelValidationError
from shared.runtime.service import ServiceRuntime

log = logging.getLogger("kvmesh.engine_worker")

STEP_COMPILED = Gauge(
    "kvmesh_step_compiled",
    "Torch backend: 1 when the step runs compiled, 0 on the eager step (a first start serves on "
    "it while its programs compile, and on for good if that failed: "
    "kvmesh_step_preparation_failed)",
)
STEP_PREPARATION_FAILED = Gauge(
    "kvmesh_step_preparation_failed",
    "1 when preparing the compiled step failed and the eager step serves on (the worker's log "
    "says why; the next start prepares again)",
)
MODEL_LOAD_SECONDS = Gauge(
    "kvmesh_model_load_seconds",
    "Seconds of this worker's start by phase: load (source or prepared artifact), prepare "
    "(packing), compile (tracing the step), warmup (first steps and fixtures), store",
    ["phase"],
)
# SERVING once the compiled step serves, NOT_SERVING while the eager step does (compiling, or
# failed). The worker's own readiness does not depend on it: the eager step serves.
COMPILED_STEP_HEALTH = "kvmesh.v1.EngineWorker/compiled-step"


async def finish_preparation(
    worker: Any, runtime: ServiceRuntime, in_torch_thread: Callable[..., Awaitable[Any]]
) -> None:
    """Serving on the eager step meanwhile: the stored programs switched in between two steps
    once the child preparing them has exited (background_preparation.py), or the failure said."""
    pending = worker.pending_preparation
    if pending is not None:
        try:  # the child's exit and the artifact's digests: off the torch thread
            await asyncio.to_thread(pending.wait)
        except (RuntimeError, ModelValidationError) as error:
            if not runtime.draining:  # stopped: the child was stopped
                reason = str(error).splitlines()[0][:300]  # what `kvmesh up` prints
                log.error(PREPARATION_FAILED, extra={"reason": reason, "error": str(error)[-1000:]})
    compiled = await in_torch_thread(worker.finish_preparation)
    await report_preparation(worker, runtime, failed=not compiled and not runtime.draining)
    if compiled:
        log.info(COMPILED_SERVING, extra={"preparation": worker.manifest.preparation})


async def report_preparation(worker: Any, runtime: ServiceRuntime, failed: bool = False) -> None:
    """The start's phases, and whether the compiled step serves (for a runner that has one)."""
    for phase, seconds in (worker.manifest.preparation or {}).get("phases", {}).items():
        MODEL_LOAD_SECONDS.labels(phase).set(seconds)
    step = getattr(worker.runner, "compiled", None)
    if step is None:
        return
    compiled = worker.pending_preparation is None and not step.programs.eager_fallback
    STEP_COMPILED.set(compiled)
    STEP_PREPARATION_FAILED.set(failed)
    await runtime.set_named_ready(COMPILED_STEP_HEALTH, compiled)
