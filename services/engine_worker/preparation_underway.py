"""What a preparation in progress would leave behind if its worker stopped: the children
compiling the step's programs and the staging folder. A worker stopped while it prepares
(SIGTERM, its launcher gone) abandons them before it exits, rather than wait minutes for the
compilers; a staging folder a SIGKILL left is removed by the next start (`PreparedStore.begin`).
"""

from __future__ import annotations

import itertools
import shutil
import threading
from pathlib import Path
from typing import Any

# Logged by a worker that answers on its eager step while its compiled step compiles; `kvmesh
# up` looks for it (this module imports no torch).
EAGER_WHILE_COMPILING = "serving on the eager step while the compiled step compiles"
COMPILED_SERVING = "compiled step serving"  # and the artifact stored
PREPARATION_FAILED = "preparing the compiled step failed: serving on; the next start prepares"

_lock = threading.Lock()
_tokens = itertools.count(1)
_under_way: dict[int, tuple[Path, Any]] = {}


def under_way(staging: Path, table: Any) -> int:
    """Registers a preparation filling `staging` and compiling into `table` (a ProgramTable, or
    None); the token `release` takes."""
    with _lock:
        token = next(_tokens)
        _under_way[token] = (staging, table)
    return token


def release(token: int) -> None:
    """The preparation is over: stored (nothing is left to remove) or failed (its compilers
    stop, its staging folder goes)."""
    with _lock:
        found = _under_way.pop(token, None)
    if found is not None:
        _abandon(*found)


def abandon_all() -> int:
    """From any thread: stops every preparation under way; how many there were."""
    with _lock:
        found = list(_under_way.values())
        _under_way.clear()
    for staging, table in found:
        _abandon(staging, table)
    return len(found)


def _abandon(staging: Path, table: Any) -> None:
    if table is not None:
        table.abandon()
    shutil.rmtree(staging, ignore_errors=True)
