"""Services die with the launcher that started them.

`kvmesh up` (and the test and bench meshes) start every service in a session of its own, so a
terminal's Ctrl-C reaches only the launcher, which stops them in order. A launcher that is
SIGKILLed (a job timeout, the OOM killer) stops nothing: its services would keep their ports
and memory. So the launcher names itself in KVMESH_PARENT_PID, and each service watches its
parent: once it is gone (the service is re-parented), the service drains as on SIGTERM and is
gone a few seconds later whatever it was doing.

A thread, not an asyncio task: it must act while the event loop is busy (a model loading).
Redis is not ours to change: the launcher starts it with the kernel's parent-death signal.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvmesh.parent_watch")
PARENT_ENV = "KVMESH_PARENT_PID"
POLL_S = 0.5
HARD_EXIT_S = 5.0  # after the SIGTERM drain began: what still runs is killed
_PR_SET_PDEATHSIG = 1


def watch_parent() -> None:
    """Starts the watch when a launcher named itself; a no-op for a service run by hand or by
    an orchestrator."""
    expected = os.environ.get(PARENT_ENV)
    if not expected or int(expected) != os.getppid():
        return  # no launcher, or it is gone already (caught below on the next start)
    threading.Thread(target=_watch, args=(int(expected),), name="parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    log.warning("the launcher is gone: stopping", extra={"launcher_pid": parent})
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(HARD_EXIT_S)
    os._exit(1)


def parent_death_signal(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """For a child we do not own the code of (redis-server), or one that must not outlive us (a
    compiling child): a preexec_fn that has the kernel send it `signum` when the thread that
    started it exits. libc is looked up here, in the parent: the child between fork and exec
    only makes the one call. None where there is no prctl."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    number = int(signum)
    return lambda: prctl(_PR_SET_PDEATHSIG, number)
