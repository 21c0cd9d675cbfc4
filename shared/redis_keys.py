"""The Redis key layout every service agrees on. Redis holds signals, never request state:
losing it degrades routing and admission to local decisions, it never fails a request."""

from __future__ import annotations

PREFIX = "kvmesh"
LOAD_TTL_MS = 3000  # a scheduler that stops publishing drops out after this


def scheduler_load(scheduler_address: str) -> str:
    """Hash of one scheduler's load report fields; expires unless refreshed (a heartbeat)."""
    return f"{PREFIX}:load:{scheduler_address}"
