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

import contextlib
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


def parent_death_signal() -> Callable[[], None] | None:
    """For a child we do not own the code of (redis-server): a preexec_fn that has the kernel
    SIGKILL it when the thread that started it exits. libc is looked up here, in the parent:
    the child between fork and exec only makes the one call. None where there is no prctl.
    Not for a parent with other threads (a gRPC server's): see `die_with_parent`."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    kill = int(signal.SIGKILL)
    return lambda: prctl(_PR_SET_PDEATHSIG, kill)


PARENT_PID_ENV = "KVMESH_STARTED_BY_PID"


def die_with_parent(signum: int) -> None:
    """Called first thing by a child of ours (a compiling or preparing child): the kernel sends
    it `signum` when the thread that started it exits. Set by the child itself: a preexec_fn is
    unsafe in a process with other threads (Python's subprocess documentation), and a worker
    has gRPC's. A parent already gone by then is caught too."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and int(expected) != os.getppid():
        os.kill(os.getpid(), signum)
