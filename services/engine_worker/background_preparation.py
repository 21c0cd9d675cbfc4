"""A served worker's first start: it packs its own weights and answers on the eager step within
seconds, while a child process prepares the model as a `--prepared wait` worker would (packs,
exports and compiles the step's programs, records the fixture, stores the artifact). Once the
child has stored it, the worker loads the stored programs between two steps, checks the
artifact's fixture with them on blocks the scheduler was never given, and the compiled step
serves from the next step.

A child, not threads of the worker: exporting the two programs is ~30 s of Python on the torch
thread (2 cores), which would stall every step; in its own process it only shares the cores.
The packing is deterministic, so the worker's weights are the artifact's, bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
from typing import Any, Protocol

import torch

from services.engine_worker import preparation_underway
from services.engine_worker.preparation_underway import PREPARATION_FAILED
from services.engine_worker.prepared_artifact import (
    PreparedArtifact,
    PreparedKey,
    PreparedStore,
    step_limits_of,
)
from services.engine_worker.preparing import PROGRAMS
from services.engine_worker.torch_backend.saved_programs import PROGRAM_SUFFIX
from shared.config import EngineConfig, KVTierConfig
from shared.runtime.parent_watch import PARENT_PID_ENV

log = logging.getLogger("kvmesh.engine_worker.preparation")

CHILD_MODULE = "services.engine_worker.prepare_in_child"
CHILD_KV_BYTES = 16 << 20  # its pool only runs the warm-up and the fixture
STOP_GRACE_S = 5.0  # a stopped child removes its staging folder and stops its compilers


def child_config(config: EngineConfig) -> EngineConfig:
    """The worker's config as the child prepares with it: the same key, no tiers, a small pool
    (the KV budget is not part of the key), ready only once stored."""
    return dataclasses.replace(
        config,
        prepared="wait",
        cache=dataclasses.replace(config.cache, kv_memory_bytes=CHILD_KV_BYTES),
        kv_tiers=KVTierConfig(),
    )


class ChildPreparation:
    """The child preparing the artifact this worker will switch to."""

    def __init__(self, config: EngineConfig, key: PreparedKey, store: PreparedStore) -> None:
        self.key, self.store = key, store
        self.step_limits = step_limits_of(config.scheduler)
        self.log = store.writable_root() / f".prepare-{key.id}.log"
        with open(self.log, "w") as out:
            # Its own session: a stop reaches it alone, and it stops its compilers itself.
            self.process = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
            )
        if self.process.stdin is not None:
            self.process.stdin.write(pickle.dumps(child_config(config)))
            self.process.stdin.close()
        self.token = preparation_underway.under_way(self.stop)
        self.artifact: PreparedArtifact | None = None
        self.serving_threads = 1  # the worker's torch threads once it no longer shares cores

    def wait(self) -> None:
        """Blocks until the child exits, then verifies what it stored (any thread: no torch)."""
        code = self.process.wait()
        preparation_underway.forget(self.token)
        found = self.store.lookup(self.key, self.step_limits).artifact
        if code != 0 or found is None:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{_how_it_ended(code, tail)}\nthe end of its log: {tail}")
        found.verify()
        self.artifact = found
        self.log.unlink(missing_ok=True)

    def stop(self) -> None:
        """SIGTERM, its grace period, then SIGKILL (any thread)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.unlink(missing_ok=True)


def _how_it_ended(code: int, tail: str) -> str:
    """One line: how the child ended, and its error's last line (a compiler's own words come
    last; its log records are JSON lines)."""
    if code < 0:
        return f"the child preparing the model was killed by {signal.Signals(-code).name}"
    words = [line for line in tail.splitlines() if line.strip() and not line.startswith("{")]
    said = f": {words[-1].strip()[-300:]}" if words else ""
    how = f"exited with {code}" if code else "exited without storing the artifact"
    return f"the child preparing the model {how}{said}"


class ServingWorker(Protocol):
    """What switching to the stored programs reads of the worker, and sets."""

    runner: Any
    pending_preparation: ChildPreparation | None
    preparation: Any  # preparation.Preparation: its source and directory change
    scratch_start: int

    def greedy(self, prompt_ids: list[int], max_tokens: int, first_block: int = 0) -> list[int]: ...


def finish_pending(worker: ServingWorker) -> bool:
    """Between two steps, once the child has stored the artifact (`ChildPreparation.wait`):
    its programs loaded and checked by its fixture on the worker's own blocks; whether the
    compiled step serves. Otherwise the eager step serves on and the next start prepares."""
    child, worker.pending_preparation = worker.pending_preparation, None
    if child is None:
        return False
    torch.set_num_threads(child.serving_threads)  # called on the torch thread
    if child.artifact is None:
        worker.preparation.source = "failed"
        return False
    stored, compiled = child.artifact, worker.runner.compiled
    if compiled is not None:
        load_programs(compiled, stored)
    fixture = stored.manifest["fixture"]
    found = worker.greedy(
        list(fixture["prompt_ids"]), len(fixture["expected_ids"]), worker.scratch_start
    )
    if found != fixture["expected_ids"]:
        if compiled is not None:
            compiled.programs.programs.clear()
        log.error(
            PREPARATION_FAILED,
            extra={"expected": fixture["expected_ids"], "found": found, "artifact": stored.id},
        )
        worker.preparation.source = "failed"
        return False
    if compiled is not None:
        compiled.programs.eager_fallback = False
    worker.preparation.source, worker.preparation.directory = "prepared", str(stored.directory)
    for phase in ("compile", "store"):  # spent in the child
        worker.preparation.phases[phase] = float(stored.manifest["phases"].get(phase, 0.0))
    return True


def load_programs(compiled: Any, stored: PreparedArtifact) -> None:
    """A stored artifact's step programs into a runner's compiled step."""
    programs = stored.directory / PROGRAMS
    compiled.load_programs(
        {name: programs / f"{name}{PROGRAM_SUFFIX}" for name in stored.manifest["step_programs"]}
    )
