"""What the scheduler's step loop keeps per open request stream, and its step counters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.scheduler.request_trace import RequestTrace
from shared.pb.kvmesh.v1 import scheduler_pb2


@dataclass
class Tracked:
    """A request with an open Submit stream."""

    request_id: str
    trace: RequestTrace  # also its arrival, first step and first token times
    events: asyncio.Queue[scheduler_pb2.SubmitEvent] = field(default_factory=asyncio.Queue)
    output_tokens: int = 0
    timer: asyncio.TimerHandle | None = None


@dataclass
class Counters:
    steps: int = 0
    worker_compute_ms: float = 0.0
    aborted: int = 0
    expired_waiting: int = 0
    expired_running: int = 0
    failed_execution: int = 0
