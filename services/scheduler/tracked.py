"""What the scheduler's step loop keeps per open request stream, and its step counters."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.scheduler.request_trace import RequestTrace
from services.scheduler.submit_lanes import LaneWriter
from shared.pb.kvmesh.v1 import scheduler_pb2
from shared.token_events import join_tokens


@dataclass
class Tracked:
    """A request with an open Submit stream."""

    request_id: str
    trace: RequestTrace  # also its arrival, first step and first token times
    events: asyncio.Queue[scheduler_pb2.SubmitEvent] = field(default_factory=asyncio.Queue)
    output_tokens: int = 0
    timer: asyncio.TimerHandle | None = None
    # Tokens sampled but not yet sent (--stream-interval above 1); sent before any terminal.
    held: scheduler_pb2.SubmitTokens | None = None
    # Set once `accepted` is out on a lane: its tokens are written straight into the lane's
    # outbox, with no queue and no task woken a token (at batch 256, 256 fewer wakes a step).
    # Terminal events still take the queue, after every token.
    lane: LaneWriter | None = None

    def hold(self, tokens: scheduler_pb2.SubmitTokens, interval: int) -> None:
        """Queues the tokens once `interval` of them are held (always the first ones)."""
        if self.held is None:
            self.held = tokens
        else:
            self.held.token_ids.extend(tokens.token_ids)
            self.held.logprobs.extend(tokens.logprobs)
        if len(self.held.token_ids) >= interval or self.held.HasField("first"):
            self.send_held()

    def hold_plain(self, token_ids: Sequence[int], interval: int) -> None:
        """`hold` for a step's tokens past the first with no logprobs: no message built for
        them alone; on a lane at stream interval 1, written straight into its outbox."""
        if interval == 1 and self.held is None and self.lane is not None:
            self.lane.plain(token_ids)
            return
        if self.held is None:
            self.held = scheduler_pb2.SubmitTokens(token_ids=token_ids)
        else:
            self.held.token_ids.extend(token_ids)
        if len(self.held.token_ids) >= interval:
            self.send_held()

    def send_held(self) -> None:
        held, self.held = self.held, None
        if held is None:
            return
        if self.lane is None:
            self.events.put_nowait(scheduler_pb2.SubmitEvent(tokens=held))
            return
        unsent = self.lane.tokens()
        if unsent.token_ids:
            join_tokens(unsent, held)
        else:
            unsent.CopyFrom(held)  # its first-token timings too


@dataclass
class Counters:
    steps: int = 0
    worker_compute_ms: float = 0.0
    aborted: int = 0
    expired_waiting: int = 0
    expired_running: int = 0
    failed_execution: int = 0
