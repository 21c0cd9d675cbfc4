"""What a step does when computing one request raises: that request fails alone.

A failure is classified once (out of memory or not) and becomes a `FailedRequest`: the
scheduler ends that request with a non-retryable `failed` event and frees its blocks, while
every other request of the batch keeps its token. The worker's circuit breaker counts them.

The fault injector is a test hook, off unless the worker is started with
`--inject-fault-token`: a request whose prompt holds that token id fails once it has that many
output tokens, so a test can poison one request of a running batch through the public API.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.engine_worker.step_inputs import RequestState
from shared.errors import Reason
from shared.step import FailedRequest, SampledToken

log = logging.getLogger("kvmesh.engine_worker.failures")


class NonFiniteLogits(ArithmeticError):
    """A NaN or infinite logit: no token can be sampled from that row."""


class InjectedFault(RuntimeError):
    """Raised by the fault injector (tests only)."""


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    # torch.OutOfMemoryError and cupy's OutOfMemoryError, without importing cupy on CPU.
    return type(error).__name__ == "OutOfMemoryError"


def failure_of(request_id: str, error: BaseException) -> FailedRequest:
    """Logs the exception with its traceback (the class travels on; the text stays here)."""
    reason = Reason.OUT_OF_MEMORY if _is_out_of_memory(error) else Reason.EXECUTION_FAILED
    log.error(
        "request failed in a step",
        exc_info=not isinstance(error, InjectedFault),
        extra={
            "request_id": request_id,
            "reason": reason.value,
            "error_type": type(error).__name__,
        },
    )
    return FailedRequest(request_id, reason.value, type(error).__name__)


@dataclass(frozen=True)
class FaultInjector:
    """Fails a request whose prompt holds `token_id` once it has `after_tokens` output tokens."""

    token_id: int
    after_tokens: int = 1

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjector | None:
        """`TOKEN_ID` or `TOKEN_ID:AFTER_TOKENS`; None or "" is off."""
        if not spec:
            return None
        token, _, after = spec.partition(":")
        return cls(int(token), int(after or 1))

    def check(self, prompt: list[int], num_output_tokens: int) -> None:
        if num_output_tokens >= self.after_tokens and self.token_id in prompt:
            raise InjectedFault(f"injected fault after {num_output_tokens} tokens")


Scheduled = list[tuple[RequestState, int]]
StepOutcome = tuple[list[SampledToken], list[FailedRequest]]


def run_isolated(run: Callable[[Scheduled], StepOutcome], scheduled: Scheduled) -> StepOutcome:
    """`run` on the whole batch; if that raises, on each request alone, so only the ones that
    fail alone fail. Nothing is kept from a raised pass: the K/V rows it wrote are written
    again, and `run` moves a request's token counts only once its pass returned."""
    try:
        return run(scheduled)
    except Exception as error:  # isolated below
        if len(scheduled) == 1:
            return [], [failure_of(scheduled[0][0].request_id, error)]
        log.warning(
            "a step raised; running its requests one at a time",
            extra={"error_type": type(error).__name__, "batch_size": len(scheduled)},
        )
    sampled: list[SampledToken] = []
    failed: list[FailedRequest] = []
    for pair in scheduled:
        one_sampled, one_failed = run_isolated(run, [pair])
        sampled += one_sampled
        failed += one_failed
    return sampled, failed


class BreakerDefaults:
    max_failures = 8
    window_s = 60.0
    cooldown_s = 30.0


class CircuitBreaker:
    """Trips when `max_failures` requests failed within `window_s`: the worker then reports
    itself not ready (the scheduler drains it, the gateway routes elsewhere) for `cooldown_s`,
    after which it serves again and the count starts over. max_failures 0 turns it off."""

    def __init__(
        self,
        max_failures: int = BreakerDefaults.max_failures,
        window_s: float = BreakerDefaults.window_s,
        cooldown_s: float = BreakerDefaults.cooldown_s,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self._failures: deque[float] = deque()
        self.open_until = 0.0  # monotonic time the worker may serve again

    def record(self, num_failed: int, now: float | None = None) -> bool:
        """Counts a step's failures; True when this step tripped the breaker."""
        if num_failed == 0 or self.max_failures <= 0:
            return False
        now = time.monotonic() if now is None else now
        self._failures.extend([now] * num_failed)
        while self._failures and self._failures[0] < now - self.window_s:
            self._failures.popleft()
        if len(self._failures) < self.max_failures or now < self.open_until:
            return False
        self._failures.clear()
        self.open_until = now + self.cooldown_s
        return True
