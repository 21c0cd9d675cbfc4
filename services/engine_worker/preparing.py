"""Preparing a model anew, in two halves around the warm-up steps: `start` opens the staging
folder and points the step's program table at it, so that the warm-up steps export the step's
programs and start compiling each in a child process (minutes on a 2-core machine, most of a
cold start); `finish` waits for them, loads them, records the fixture and stores the artifact.
Until it is stored, the preparation is registered in preparation_underway, so that a stopped
worker leaves neither compilers nor a staging folder behind.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.engine_worker import preparation_underway
from services.engine_worker.prepared_artifact import PreparedKey, PreparedStore
from services.engine_worker.torch_backend.saved_programs import PROGRAM_SUFFIX, ProgramTable

log = logging.getLogger("kvmesh.engine_worker.preparation")

PROGRAMS = "programs"
# A prepared artifact's own fixture: greedy tokens after a fixed prompt, reproduced at load.
FIXTURE_PROMPT = tuple(range(1, 25))
FIXTURE_TOKENS = 4


def fixture_blocks(block_size: int) -> int:
    return -(-(len(FIXTURE_PROMPT) + FIXTURE_TOKENS) // block_size)


class Greedy(Protocol):
    def __call__(self, prompt_ids: list[int], max_tokens: int) -> list[int]: ...


@dataclass
class Started:
    """A preparation between its halves; it holds the key's lock until it is stored."""

    runner: Any
    num_parameters: int
    key: PreparedKey
    store: PreparedStore
    staging: Path
    table: ProgramTable | None
    lock: ExitStack
    step_limits: dict[str, int]  # the worker's, recorded with the artifact
    token: int = 0  # its entry in preparation_underway


def start(
    runner: Any,
    num_parameters: int,
    key: PreparedKey,
    store: PreparedStore,
    lock: ExitStack,
    step_limits: dict[str, int],
) -> Started:
    """Called before the warm-up steps: they compile the programs into the staging folder."""
    staging = store.begin(key)
    table = runner.compiled.programs if runner.compiled is not None else None
    if table is not None:
        table.record_into(staging / PROGRAMS)
    started = Started(runner, num_parameters, key, store, staging, table, lock, step_limits)
    started.token = preparation_underway.under_way(
        lambda: preparation_underway.abandon_staging(staging, table)
    )
    return started


def release(started: Started) -> None:
    """Ends a preparation that will not be finished: its children, staging folder and lock go."""
    preparation_underway.release(started.token)
    started.lock.close()


def finish(started: Started, greedy: Greedy, phases: dict[str, float]) -> Path:
    """Loads the compiled programs, records the fixture, stores the artifact (with `phases`,
    which gains this half's compile wait and store), lets go of the lock; the stored folder. On
    any failure the staging folder and the children go."""
    from services.engine_worker.torch_backend.packed_state import save_packed

    table = started.table
    try:
        if table is not None:
            log.info("waiting for the step's programs to compile (AOTInductor, C++)")
            compiling = time.perf_counter()
            try:
                table.finish()
            finally:
                table.record_into(None)
            phases["compile"] = phases.get("compile", 0.0) + time.perf_counter() - compiling
        fixture = greedy(list(FIXTURE_PROMPT), FIXTURE_TOKENS)
        saving = time.perf_counter()
        files = save_packed(started.runner.model.weights, str(started.staging))
        programs = sorted(table.compiled) if table is not None else []
        files += [f"{PROGRAMS}/{name}{PROGRAM_SUFFIX}" for name in programs]
        stored = started.store.commit(
            started.key,
            started.staging,
            files,
            {
                "num_parameters": started.num_parameters,
                "step_programs": programs,
                # Which workers may load it (PreparedArtifact.step_limits_mismatch).
                "step_limits": started.step_limits,
                "programs_take_any_size": table is None or all(table.takes_any_size.values()),
                "fixture": {"prompt_ids": list(FIXTURE_PROMPT), "expected_ids": fixture},
                "phases": {name: round(seconds, 3) for name, seconds in phases.items()},
            },
        )
        phases["store"] = time.perf_counter() - saving
        return stored.directory
    finally:
        release(started)  # abandons what is left when it did not get this far
