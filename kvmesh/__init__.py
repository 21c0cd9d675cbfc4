"""kvmesh: an LLM inference engine and a mesh of small services around it.

The `kvmesh` package sits on top of the services: the in-process Engine and the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.engine import Completion, Engine

__all__ = ["Completion", "Engine"]


def __getattr__(name: str) -> Any:
    """The Engine on first use: `kvmesh up` and the other commands that only launch or call
    services do not import torch (2.7 s of the launcher's start on 2 cores)."""
    if name in __all__:
        from kvmesh import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
