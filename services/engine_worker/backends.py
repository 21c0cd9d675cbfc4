"""Compute backends by name, imported lazily so a machine pays only for the one it runs."""

from __future__ import annotations

from shared.errors import KvmeshError, Reason

# name -> module that provides `CausalLM`; the torch path is the reference implementation.
BACKENDS = {"torch": "services.engine_worker.model"}


def resolve_backend(name: str) -> str:
    """'auto' picks the best available backend; today that is always torch."""
    if name == "auto":
        return "torch"
    if name not in BACKENDS:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}",
        )
    return name
