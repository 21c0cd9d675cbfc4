"""GPU time per step, apart from the host's: CUDA events on the steps' stream around each
step's forward (the graph replay or the eager launches, the input copy included), read once the
step's results are on the host. Off unless a caller (bench-gpu) turns it on: two event records
and one read a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import cupy


@dataclass
class StepTiming:
    gpu_ms: list[float] = field(default_factory=list)  # one per step, in order
    replayed: list[bool] = field(default_factory=list)  # the step ran as a CUDA graph
    _events: tuple[Any, Any] = field(default_factory=lambda: (cupy.cuda.Event(), cupy.cuda.Event()))

    def start(self, stream: Any) -> None:
        self._events[0].record(stream)

    def stop(self, stream: Any, replayed: bool) -> None:
        self._events[1].record(stream)
        self.replayed.append(replayed)

    def read(self) -> None:
        """After the step's synchronisation: the events have completed."""
        start, stop = self._events
        self.gpu_ms.append(float(cupy.cuda.get_elapsed_time(start, stop)))
