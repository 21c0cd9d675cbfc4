"""kvmesh: an LLM inference engine and a mesh of small services around it.

The `kvmesh` package sits on top of the services: the in-process Engine and the CLI.
"""

from kvmesh.engine import Completion, Engine

__all__ = ["Completion", "Engine"]
