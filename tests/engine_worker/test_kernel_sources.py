"""Every CUDA kernel compiles for sm_90 (Hopper) with nvcc, on machines without a GPU too, and
without register spills; a broken source fails the check."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine_worker.cupy_backend.kernels.compile_check import compile_cubin, nvcc
from services.engine_worker.cupy_backend.kernels.library import KERNEL_DIR, sources

pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")

OPS = [
    "bias_add",
    "embedding",
    "greedy_sample",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary",
    "silu_and_mul",
]


def test_each_op_has_a_source_and_a_launcher() -> None:
    assert [source.stem for source in sources()] == OPS
    for op in OPS:
        assert (KERNEL_DIR / f"{op}.py").exists(), op


@pytest.mark.parametrize("source", sources(), ids=lambda path: path.name)
def test_kernel_compiles_for_sm90_without_spills(source: Path) -> None:
    report = compile_cubin(source, "sm_90")
    assert report.returncode == 0, report.output
    assert "ptxas info" in report.output  # ptxas really ran (-v)
    assert report.spilled_bytes == 0, report.output


def test_a_compile_error_fails_the_check(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cu"
    broken.write_text('#include "common.cuh"\nextern "C" __global__ void f() { undeclared(); }\n')
    report = compile_cubin(broken, "sm_90")
    assert report.returncode != 0 and "undeclared" in report.output
