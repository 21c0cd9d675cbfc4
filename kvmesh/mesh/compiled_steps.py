"""What `kvmesh up` says of workers that answered on their eager step while their compiled
step compiled: once each, that the compiled step serves, or that preparing it failed (with the
worker's reason) and the eager step serves on. Read from the workers' logs."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from kvmesh.mesh.service_process import PROGRESS_EVERY_S, ServiceProcess
from services.engine_worker.preparation_underway import (
    COMPILED_SERVING,
    EAGER_WHILE_COMPILING,
    PREPARATION_FAILED,
)


class CompiledStepWatch:
    """The workers whose compiled step is still compiling, until `report` has said how each
    ended."""

    def __init__(self, services: Iterable[ServiceProcess]) -> None:
        self.pending = [s for s in services if s.has_logged(EAGER_WHILE_COMPILING)]
        self.failed: list[str] = []

    def report(self) -> None:
        for service in list(self.pending):
            if service.has_logged(COMPILED_SERVING):
                print(f"kvmesh: {service.name}: compiled step serving", file=sys.stderr)
            elif (failure := service.logged(PREPARATION_FAILED)) is not None:
                self.failed.append(service.name)
                print(failure_line(service.name, failure, service.log_path), file=sys.stderr)
            else:
                continue
            self.pending.remove(service)

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks while a pending worker still runs and its compiled step has neither served nor
        failed, with a line every PROGRESS_EVERY_S. Benchmarks wait so: meanwhile the eager
        step serves on the cores the compilers share (docs/benchmarks/cpu-engine.md)."""
        started = time.monotonic()
        next_note = started + PROGRESS_EVERY_S
        while any(s.process.poll() is None for s in self.pending):
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the compiled step never served after {timeout_s:.0f}s")
            time.sleep(1.0)
            self.report()
            if self.pending and time.monotonic() >= next_note:
                print(f"kvmesh: still compiling ({next_note - started:.0f}s)", file=sys.stderr)
                next_note += PROGRESS_EVERY_S


def failure_line(name: str, failure: dict[str, object], log_path: str) -> str:
    """One line for a failed preparation: the worker's reason, or the fixture that did not
    reproduce."""
    if failure.get("reason"):
        why = str(failure["reason"])
    elif "found" in failure:
        why = "its fixture's greedy tokens differed from those recorded"
    else:
        why = "see its log"
    return (
        f"kvmesh: {name}: preparing its compiled step failed ({why}); it serves on its eager "
        f"step, slower, and the next start prepares again (log: {log_path})"
    )
