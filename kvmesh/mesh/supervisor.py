"""`kvmesh up`'s supervisor: a service that exits is started again, same command, same port.

What Kubernetes' `restartPolicy: Always` does for a pod: every mesh process (redis-server,
trace-collector, tokenizer, engine-workers, schedulers, gateway) that exits is restarted after
a back-off (shared/runtime/restarts.py) that starts at 1 s and doubles to 30 s, and starts over
once the service has stayed up for a minute. Each restart is a line on the launcher's stderr
and a count in `kvmesh_service_restarts_total{service}`. A service stopped on purpose (a
drain, a rollout, Ctrl-C) is never restarted. Its peers find it again as they would after any
restart: the scheduler reattaches its worker, the gateway watches health.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from kvmesh.mesh.service_process import ServiceProcess
from shared.runtime.restarts import BackOff, RestartClock

RESTARTS = Counter(
    "kvmesh_service_restarts", "Mesh services restarted after they exited", ["service"]
)
POLL_S = 0.2


class Supervisor:
    def __init__(
        self, services: Callable[[], Sequence[ServiceProcess]], back_off: BackOff | None = None
    ) -> None:
        self.services = services  # the mesh's, now: a rollout adds and removes some
        self.back_off = back_off or BackOff()
        self._clocks: dict[str, RestartClock] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self, now: float | None = None) -> list[str]:
        """Restarts each service whose back-off ran out since it exited; their names."""
        now = time.monotonic() if now is None else now
        restarted = []
        for service in list(self.services()):
            clock = self._clocks.setdefault(service.name, RestartClock(self.back_off, now))
            if service.stopping or service.process.poll() is None:
                continue
            if clock.restart_at is None:
                delay_s = clock.exited(now)
                code = service.process.returncode
                print(
                    f"kvmesh: {service.name} exited ({code}); restarting in {delay_s:.0f}s"
                    f" (log: {service.log_path})",
                    file=sys.stderr,
                    flush=True,
                )
            if not clock.due(now) or not service.revive():
                continue
            RESTARTS.labels(service.name).inc()
            restarted.append(service.name)
            clock.restarted(now)
        return restarted

    def started(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
