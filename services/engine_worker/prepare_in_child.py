"""`python -m services.engine_worker.prepare_in_child`: prepares a model and stores its prepared
artifact for the served worker that started it (background_preparation.py), reading that
worker's config, pickled, on stdin. It is a worker in `--prepared wait` mode that never serves.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import NoReturn

from services.engine_worker.worker import Worker
from shared.runtime.logs import configure_logging
from shared.runtime.parent_watch import die_with_parent

CHILD_NICENESS = 10


def _stopped(signum: int, frame: object) -> NoReturn:
    # An exception, not a kill: the preparation's cleanup (compilers, staging folder) runs.
    raise SystemExit(128 + signum)


def main() -> int:
    signal.signal(signal.SIGTERM, _stopped)
    die_with_parent(signal.SIGTERM)
    # Below the serving worker, which answers meanwhile: its steps take the cores they need
    # and this child (and the compilers it starts) the rest.
    os.nice(CHILD_NICENESS)
    config = pickle.load(sys.stdin.buffer)  # from the parent process, never from a client
    configure_logging("engine-worker-preparation", "info")
    Worker(config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
