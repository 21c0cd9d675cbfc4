"""What a preparation in progress would leave behind if its worker stopped: the children
compiling the step's programs, the staging folder, a child process preparing the model. A worker
stopped while it prepares (SIGTERM, its launcher gone) abandons them before it exits, rather
than wait minutes for the compilers; a staging folder a SIGKILL left is removed by the next
start (`PreparedStore.begin`). This module imports no torch: `kvmesh up` reads its messages.
"""

from __future__ import annotations

import itertools
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Logged by a worker that answers on its eager step while its compiled step compiles; `kvmesh
# up` looks for them.
EAGER_WHILE_COMPILING = "serving on the eager step while the compiled step compiles"
COMPILED_SERVING = "compiled step serving"  # and the artifact stored
PREPARATION_FAILED = "preparing the compiled step failed: serving on; the next start prepares"

_lock = threading.Lock()
_tokens = itertools.count(1)
_under_way: dict[int, Callable[[], None]] = {}


def under_way(abandon: Callable[[], None]) -> int:
    """Registers what stops a preparation and removes what it left; the token for `release`."""
    with _lock:
        token = next(_tokens)
        _under_way[token] = abandon
    return token


def release(token: int) -> None:
    """The preparation is over: stored (its abandon finds nothing left to remove) or failed
    (its compilers stop, its staging folder goes)."""
    with _lock:
        abandon = _under_way.pop(token, None)
    if abandon is not None:
        abandon()


def forget(token: int) -> None:
    """Over, with nothing to abandon (a child process that has exited)."""
    with _lock:
        _under_way.pop(token, None)


def abandon_all() -> int:
    """From any thread: stops every preparation under way; how many there were."""
    with _lock:
        found = list(_under_way.values())
        _under_way.clear()
    for abandon in found:
        abandon()
    return len(found)


def abandon_staging(staging: Path, table: Any) -> None:
    """A preparation in this process: its compilers (a ProgramTable, or None) and its folder."""
    if table is not None:
        table.abandon()
    shutil.rmtree(staging, ignore_errors=True)
