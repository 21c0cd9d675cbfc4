"""The Redis key layout every service agrees on. Redis holds signals, never request state:
losing it degrades routing and admission to local decisions, it never fails a request."""

from __future__ import annotations

PREFIX = "kvmesh"
HEARTBEAT_S = 0.5  # a scheduler refreshes its keys at least this often
LOAD_TTL_MS = 2000  # a scheduler that stops publishing drops out after this
PREFIX_TTL_MS = 5000  # ... and its prefix-cache entries after this


def scheduler_load(scheduler_address: str) -> str:
    """Hash of one scheduler's load report fields; expires unless refreshed (a heartbeat)."""
    return f"{PREFIX}:load:{scheduler_address}"


def salt_id(cache_salt: bytes) -> str:
    return cache_salt.hex() or "nosalt"


def prefix_blocks(model: str, cache_salt: bytes, scheduler_address: str) -> str:
    """Set of the chained block hashes (decimal) one scheduler holds for one model and tenant
    salt. Scoping by salt keeps tenants apart in routing as the salted hashes do in the cache."""
    return f"{PREFIX}:prefix:{model}:{salt_id(cache_salt)}:{scheduler_address}"


def prefix_blocks_pattern(model: str, scheduler_address: str) -> str:
    """SCAN pattern for every prefix set of one scheduler (to clear them after a restart)."""
    return f"{PREFIX}:prefix:{model}:*:{scheduler_address}"


def tenant_requests_bucket(tenant: str) -> str:
    return f"{PREFIX}:tenant:{tenant}:requests"


def tenant_tokens_bucket(tenant: str) -> str:
    return f"{PREFIX}:tenant:{tenant}:tokens"


def tenant_in_flight(tenant: str) -> str:
    """Sorted set: request id -> lease expiry (ms); expired leases no longer count."""
    return f"{PREFIX}:tenant:{tenant}:in-flight"


def tenant_request_ids(tenant: str) -> str:
    """Sorted set: a client-chosen request id open on some gateway -> lease expiry (ms)."""
    return f"{PREFIX}:tenant:{tenant}:request-ids"
