"""One tenant's limits enforced by this gateway alone, while Redis is unreachable: the same
verdicts as rate_limits.py's scripts, from in-process buckets and counts."""

from __future__ import annotations

import math
import time

from shared.tenants import Tenant

# Verdicts, as the shared script returns them: 0 admitted, else the limit it is over.
OVER_REQUESTS, OVER_TOKENS, OVER_CONCURRENCY, OVER_IN_FLIGHT_TOKENS = 1, 2, 3, 4


class LocalBucket:
    def __init__(self, rate_per_s: float, capacity: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self.at = time.monotonic()

    def refill(self) -> float:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate_per_s)
        self.at = now
        return self.level


class LocalLimits:
    def __init__(self, tenant: Tenant) -> None:
        limits = tenant.limits
        rps, tpm = limits.requests_per_second, limits.tokens_per_minute
        self.requests = LocalBucket(rps, max(1.0, rps)) if rps else None
        self.tokens = LocalBucket(tpm / 60, tpm) if tpm else None
        self.max_concurrent = limits.max_concurrent
        self.max_in_flight_tokens = limits.max_in_flight_tokens
        self.sequences = 0  # in flight: each of a request's n completions counts
        self.tokens_in_flight = 0

    def admit(self, token_cost: int, num_sequences: int = 1) -> tuple[int, int]:
        if self.requests is not None and self.requests.refill() < 1:
            wait_s = (1 - self.requests.level) / self.requests.rate_per_s
            return OVER_REQUESTS, math.ceil(wait_s * 1e3)
        charged = token_cost
        if self.tokens is not None:
            charged = min(token_cost, int(self.tokens.capacity))
            if self.tokens.refill() < charged:
                wait_s = (charged - self.tokens.level) / self.tokens.rate_per_s
                return OVER_TOKENS, math.ceil(wait_s * 1e3)
        if self.max_concurrent and self.sequences + num_sequences > self.max_concurrent:
            return OVER_CONCURRENCY, 0
        in_flight = self.tokens_in_flight + token_cost
        if self.max_in_flight_tokens and in_flight > self.max_in_flight_tokens:
            return OVER_IN_FLIGHT_TOKENS, 0
        if self.requests is not None:
            self.requests.level -= 1
        if self.tokens is not None:
            self.tokens.level -= charged
        self.sequences += num_sequences
        self.tokens_in_flight = in_flight
        return 0, 0

    def charge(self, tokens: int) -> float | None:
        if self.tokens is None:
            return None
        before = self.tokens.refill()
        self.tokens.level = max(0.0, before - tokens)
        return before

    def release(self, refund: int, num_sequences: int, in_flight_tokens: int) -> None:
        self.sequences -= num_sequences
        self.tokens_in_flight -= in_flight_tokens
        if self.tokens is not None:
            self.tokens.level = min(self.tokens.capacity, self.tokens.refill() + refund)
