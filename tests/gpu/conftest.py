"""GPU tests: every kernel against its torch reference, and the cupy backend against the torch
backend. Not collected where CuPy sees no GPU (CI); `make test-gpu` runs them on a GPU.

KVMESH_CUPY_STANDIN=1 runs them on the CPU stand-in for CuPy (tests/cupy_standin/): the
kernels' numpy references against the torch ones, and a rehearsal of the GPU suite."""

from __future__ import annotations

import os

from services.engine_worker.backends import cuda_devices

STANDIN = os.environ.get("KVMESH_CUPY_STANDIN") == "1"
if STANDIN:
    from tests.cupy_standin import installed

    _standin = installed()  # held for the whole session: nothing else in it needs CuPy
    _standin.__enter__()

HAS_GPU = cuda_devices() > 0
collect_ignore_glob = [] if HAS_GPU else ["test_*.py"]


def pytest_report_header() -> str:
    if STANDIN:
        return "GPU tests: on the CPU stand-in for CuPy"
    return "GPU tests: " + ("on" if HAS_GPU else "not collected (no GPU visible to CuPy)")
