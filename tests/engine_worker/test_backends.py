"""Choosing a backend: auto takes cupy only where CuPy sees a GPU; asking for cupy without
one is a clear INVALID_ARGUMENT, not a crash at the first step."""

from __future__ import annotations

import pytest

from services.engine_worker import backends
from shared.errors import KvmeshError, Reason


def test_auto_and_explicit_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "cuda_devices", lambda: 0)
    assert backends.resolve_backend("auto") == "torch"
    assert backends.resolve_backend("torch") == "torch"
    with pytest.raises(KvmeshError) as refused:
        backends.resolve_backend("cupy")
    assert refused.value.reason is Reason.INVALID_ARGUMENT and "GPU" in refused.value.message
    with pytest.raises(KvmeshError, match="available: auto, cupy, sim, torch"):
        backends.resolve_backend("tensorrt")
    monkeypatch.setattr(backends, "cuda_devices", lambda: 1)
    assert backends.resolve_backend("auto") == "cupy"


def test_no_gpu_here_means_zero_devices_not_an_error() -> None:
    assert backends.cuda_devices() >= 0  # CuPy absent or no driver: 0, never an exception
