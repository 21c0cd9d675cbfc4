"""The in-process engine: a worker and its scheduler in one process, for `kvmesh generate`,
notebooks and benchmarks."""

from kvmesh.engine.in_process import Completion, Engine

__all__ = ["Completion", "Engine"]
