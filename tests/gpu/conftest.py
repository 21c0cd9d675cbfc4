"""GPU tests: every kernel against its torch reference, and the cupy backend against the torch
backend. Not collected where CuPy sees no GPU (CI); `make test-gpu` runs them on a GPU."""

from __future__ import annotations

from services.engine_worker.backends import cuda_devices

HAS_GPU = cuda_devices() > 0
collect_ignore_glob = [] if HAS_GPU else ["test_*.py"]


def pytest_report_header() -> str:
    return "GPU tests: " + ("on" if HAS_GPU else "not collected (no GPU visible to CuPy)")
