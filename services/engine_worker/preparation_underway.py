"""What a preparation in progress would leave behind if its worker stopped: the children
compiling the step's programs and the staging folder. A worker stopped while it prepares
(SIGTERM, its launcher gone) abandons them before it exits, rather than wait minutes for the
compilers; a staging folder a SIGKILL left is removed by the next start (`PreparedStore.begin`).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_underway: dict[int, tuple[Path, Any]] = {}


@contextmanager
def underway(staging: Path, table: Any) -> Iterator[None]:
    """Registers a preparation filling `staging` and compiling into `table` (a ProgramTable, or
    None); on any exception, its compilers are stopped and the folder removed."""
    token = id(staging)
    with _lock:
        _underway[token] = (staging, table)
    try:
        yield
    except BaseException:
        _abandon(staging, table)
        raise
    finally:
        with _lock:
            _underway.pop(token, None)


def abandon_all() -> int:
    """From any thread: stops every preparation under way; how many there were."""
    with _lock:
        found = list(_underway.values())
        _underway.clear()
    for staging, table in found:
        _abandon(staging, table)
    return len(found)


def _abandon(staging: Path, table: Any) -> None:
    if table is not None:
        table.abandon()
    shutil.rmtree(staging, ignore_errors=True)
