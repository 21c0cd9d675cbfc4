"""When a supervised process that exited starts again: after 1 s, doubling with each restart to
30 s, and back to 1 s once it had stayed up a minute (a fresh failure, not a crash loop).
`kvmesh up`'s supervisor and `python -m services.gateway --processes N` both keep one a process.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackOff:
    first_s: float = 1.0
    max_s: float = 30.0
    steady_s: float = 60.0  # up this long: the next exit waits first_s again


@dataclass
class RestartClock:
    back_off: BackOff
    started_at: float
    restart_at: float | None = None  # set when its exit was seen
    delay_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay_s = self.back_off.first_s

    def exited(self, now: float) -> float:
        """Its exit, seen once: the seconds until it may start again."""
        if now - self.started_at >= self.back_off.steady_s:
            self.delay_s = self.back_off.first_s
        self.restart_at = now + self.delay_s
        return self.delay_s

    def due(self, now: float) -> bool:
        return self.restart_at is not None and now >= self.restart_at

    def restarted(self, now: float) -> None:
        self.restart_at, self.started_at = None, now
        self.delay_s = min(self.delay_s * 2, self.back_off.max_s)
