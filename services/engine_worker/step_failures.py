"""What a step does when computing one request raises: that request fails alone.

A failure is classified once (out of memory or not) and becomes a `FailedRequest`: the
scheduler ends that request with a non-retryable `failed` event and frees its blocks, while
every other request of the batch keeps its token. The worker's circuit breaker counts those
that say something of the worker.

The fault injector is a test hook, off unless the worker is started with
`--inject-fault-token`: a request whose prompt holds that token id fails once it has that many
output tokens, so a test can poison one request of a running batch through the public API (or,
with `:worker`, break the whole worker from then on).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.engine_worker.config import BreakerDefaults
from services.engine_worker.step_inputs import RequestState
from shared.errors import Reason
from shared.step import FailedRequest, SampledToken

log = logging.getLogger("kvmesh.engine_worker.failures")


class NonFiniteLogits(ArithmeticError):
    """A NaN or infinite logit: no token can be sampled from that row."""


class NoSamplingMass(ArithmeticError):
    """A row's probabilities after its own sampling parameters sum to no finite, positive mass:
    the request's parameters, not the worker (INVALID_SAMPLING_PARAMS, never the breaker's)."""


class GrammarFailed(RuntimeError):
    """The request's own response format can go no further: INVALID_SCHEMA, never a free
    sample past a broken grammar, never the breaker's."""


class InjectedFault(RuntimeError):
    """Raised by the fault injector (tests only)."""


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    # torch.OutOfMemoryError and cupy's OutOfMemoryError, without importing cupy on CPU.
    return type(error).__name__ == "OutOfMemoryError"


# Failures a request's own input causes on any worker: never the breaker's to count.
NOT_THE_WORKERS = frozenset({Reason.INVALID_SAMPLING_PARAMS.value, Reason.INVALID_SCHEMA.value})


def _reason_of(error: BaseException) -> Reason:
    if isinstance(error, NoSamplingMass):
        return Reason.INVALID_SAMPLING_PARAMS
    if isinstance(error, GrammarFailed):
        return Reason.INVALID_SCHEMA
    return Reason.OUT_OF_MEMORY if _is_out_of_memory(error) else Reason.EXECUTION_FAILED


def failure_of(request_id: str, error: BaseException) -> FailedRequest:
    """Logs the exception with its traceback (the class travels on; the text stays here)."""
    reason = _reason_of(error)
    own_input = reason.value in NOT_THE_WORKERS  # the request's doing: a warning, no traceback
    log.log(
        logging.WARNING if own_input else logging.ERROR,
        "request failed in a step",
        exc_info=not (own_input or isinstance(error, InjectedFault)),
        extra={
            "request_id": request_id,
            "reason": reason.value,
            "error_type": type(error).__name__,
        },
    )
    return FailedRequest(request_id, reason.value, type(error).__name__)


@dataclass(frozen=True)
class FaultRule:
    """A request whose prompt holds `token_id` fails once it has `after_tokens` output tokens;
    with `breaks_worker`, every request after it too, as on a broken device."""

    token_id: int
    after_tokens: int = 1
    breaks_worker: bool = False


@dataclass
class FaultInjector:
    rules: tuple[FaultRule, ...]
    broken: bool = False

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjector | None:
        """Rules `TOKEN_ID[:AFTER_TOKENS][:worker]`, separated by commas; None or "" is off."""
        if not spec:
            return None
        rules = []
        for rule in spec.split(","):
            token, _, rest = rule.partition(":")
            after, _, mode = rest.partition(":")
            rules.append(FaultRule(int(token), int(after or 1), breaks_worker=mode == "worker"))
        return cls(tuple(rules))

    def check(self, prompt: list[int], num_output_tokens: int) -> None:
        if self.broken:
            raise InjectedFault("the worker is broken (injected)")
        for rule in self.rules:
            if num_output_tokens >= rule.after_tokens and rule.token_id in prompt:
                self.broken = rule.breaks_worker
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


class CircuitBreaker:
    """Judges the worker, not the requests: trips when `max_failures` requests failed within
    `window_s` with no request sampled in between. A failure beside a request that sampled, or
    one of the request's own parameters or format (NOT_THE_WORKERS), says nothing of the
    worker and is not counted; any sampled token starts the count over. Tripped, the worker reports
    itself not ready (the scheduler drains it, the gateway routes elsewhere) for `cooldown_s`,
    then serves again. max_failures 0 turns it off."""

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

    def record(
        self, failed: Sequence[FailedRequest], num_sampled: int, now: float | None = None
    ) -> bool:
        """Counts a step's outcome (every step's: a sampled token starts the count over); True
        when this step tripped the breaker."""
        if num_sampled:
            self._failures.clear()
            return False
        counted = sum(1 for f in failed if f.reason not in NOT_THE_WORKERS)
        if counted == 0 or self.max_failures <= 0:
            return False
        now = time.monotonic() if now is None else now
        self._failures.extend([now] * counted)
        while self._failures and self._failures[0] < now - self.window_s:
            self._failures.popleft()
        if len(self._failures) < self.max_failures or now < self.open_until:
            return False
        self._failures.clear()
        self.open_until = now + self.cooldown_s
        return True
