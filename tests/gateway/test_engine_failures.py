"""TenantFailures: a tenant whose requests keep failing in the engine is refused on its own."""

from __future__ import annotations

import pytest

from services.gateway.policy.engine_failures import WINDOW_S, TenantFailures
from shared.errors import KvmeshError, Reason


def test_a_tenant_past_its_failures_is_refused_until_the_oldest_is_a_minute_old() -> None:
    failures = TenantFailures(max_per_minute=3)
    for at in (0.0, 1.0, 2.0):
        failures.check("a", now=at)
        failures.record("a", "EXECUTION_FAILED", now=at)
    with pytest.raises(KvmeshError) as caught:
        failures.check("a", now=10.0)
    error = caught.value
    assert (error.reason, error.retryable) == (Reason.RATE_LIMITED, True)
    assert error.retry_after_ms == (WINDOW_S - 10.0) * 1e3
    failures.check("b", now=10.0)  # another tenant: served
    failures.check("a", now=WINDOW_S + 0.5)  # the first failure left the window


def test_only_the_requests_own_failures_count() -> None:
    failures = TenantFailures(max_per_minute=1)
    for reason in ("WORKER_LOST", "DEADLINE_EXCEEDED", "MODEL_NOT_READY", "OVERLOADED"):
        failures.record("a", reason, now=0.0)
    failures.check("a", now=0.0)
    failures.record("a", "INVALID_SAMPLING_PARAMS", now=0.0)
    with pytest.raises(KvmeshError):
        failures.check("a", now=0.0)


def test_zero_turns_it_off() -> None:
    failures = TenantFailures(max_per_minute=0)
    for _ in range(100):
        failures.record("a", "EXECUTION_FAILED", now=0.0)
    failures.check("a", now=0.0)
