"""A tenant whose requests keep failing in the engine is refused on its own, not the mesh.

The worker's circuit breaker no longer counts a failure that one request's input causes; this is
the other half: past `max_per_minute` such failures within a minute, that tenant's new requests
are refused RATE_LIMITED (retryable, with the time until its oldest failure is a minute old),
while every other tenant is served as before. Counted per gateway, in memory: a tenant spread
over N gateways gets up to N times the allowance, as with Redis down for the rate limits.
"""

from __future__ import annotations

import collections
import math
import time

from shared.errors import KvmeshError, Reason

WINDOW_S = 60.0
DEFAULT_MAX_PER_MINUTE = 8
# Failures of a request's own computation; a lost worker, a deadline or a drain is not one.
ENGINE_FAILURES = frozenset(
    {
        Reason.EXECUTION_FAILED.value,
        Reason.OUT_OF_MEMORY.value,
        Reason.INVALID_SAMPLING_PARAMS.value,
        Reason.INVALID_SCHEMA.value,
    }
)


class TenantFailures:
    def __init__(self, max_per_minute: int = DEFAULT_MAX_PER_MINUTE) -> None:
        self.max_per_minute = max_per_minute  # 0: no limit
        self._failures: dict[str, collections.deque[float]] = {}

    def _recent(self, tenant: str, now: float) -> collections.deque[float] | None:
        failures = self._failures.get(tenant)
        while failures and failures[0] <= now - WINDOW_S:
            failures.popleft()
        if failures is not None and not failures:
            del self._failures[tenant]  # a tenant that stopped failing costs nothing
            return None
        return failures

    def check(self, tenant: str, now: float | None = None) -> None:
        """RATE_LIMITED when the tenant's requests failed in the engine too often lately."""
        now = time.monotonic() if now is None else now
        failures = self._recent(tenant, now)
        if not self.max_per_minute or failures is None or len(failures) < self.max_per_minute:
            return
        wait_s = failures[0] + WINDOW_S - now
        raise KvmeshError(
            Reason.RATE_LIMITED,
            f"{len(failures)} of this tenant's requests failed in the engine within a minute "
            f"(the limit is {self.max_per_minute}); check their sampling parameters and inputs",
            retryable=True,
            retry_after_ms=max(1, math.ceil(wait_s * 1e3)),
        )

    def record(self, tenant: str, reason: str, now: float | None = None) -> None:
        """A request of the tenant ended `failed` with this reason."""
        if not self.max_per_minute or reason not in ENGINE_FAILURES:
            return
        now = time.monotonic() if now is None else now
        self._recent(tenant, now)
        self._failures.setdefault(tenant, collections.deque()).append(now)
