"""Every CUDA kernel compiles for sm_90 (Hopper) with nvcc, on machines without a GPU too,
without register spills and within its register budget; a broken source fails the check."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine_worker.cupy_backend.kernels.compile_check import (
    CompileReport,
    compile_cubin,
    nvcc,
)
from services.engine_worker.cupy_backend.kernels.library import KERNEL_DIR, sources

pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc (CUDA toolkit) is not installed")

OPS = [
    "bias_add",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_and_cache",
    "sample_tokens",
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
    assert report.registers and max(report.registers.values()) <= report.budget, report.registers
    assert report.problem is None


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32)])
def test_the_narrowed_decode_module_holds_the_kernels_its_launcher_asks_for(
    head_dim: int, block_size: int
) -> None:
    """What NVRTC compiles at run time: only the sizes the launcher defines, under the names
    it looks up (a macro that pasted its arguments unexpanded once named them after the
    defines themselves)."""
    from services.engine_worker.cupy_backend.kernels.library import DTYPES
    from services.engine_worker.cupy_backend.kernels.paged_decode_attention import instantiation

    names, defines = set(), ()
    for spec in DTYPES.values():
        name, defines = instantiation(spec, head_dim, block_size)
        names.add(name)
    report = compile_cubin(KERNEL_DIR / "paged_decode_attention.cu", "sm_90", defines=defines)
    assert report.problem is None, report.output
    assert set(report.registers) == names


# 96 live accumulators in 32 registers (__launch_bounds__(1024, 2) leaves 32 a thread).
SPILLING = """
extern "C" __global__ void __launch_bounds__(1024, 2) many_live(const float* x, float* out, int n) {
    float acc[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = x[(threadIdx.x + i * 7) % n];
    for (int step = 0; step < n; ++step) {
#pragma unroll
        for (int i = 0; i < 96; ++i) acc[i] = acc[i] * acc[(i + 1) % 96] + x[(step + i) % n];
    }
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 96; ++i) total += acc[i];
    out[threadIdx.x] = total;
}
"""


def test_a_spilling_kernel_fails_the_check(tmp_path: Path) -> None:
    source = tmp_path / "spilling.cu"
    source.write_text(SPILLING)
    report = compile_cubin(source, "sm_90")
    assert report.returncode == 0 and report.spilled_bytes > 0
    assert report.problem is not None and "spills" in report.problem


def test_a_kernel_over_its_register_budget_fails_the_check(tmp_path: Path) -> None:
    """Without launch bounds ptxas keeps the 96 accumulators in registers: no spill, yet far
    past the 64 registers a row-wise kernel may use."""
    source = tmp_path / "greedy_registers.cu"
    source.write_text(SPILLING.replace("__launch_bounds__(1024, 2) ", ""))
    report = compile_cubin(source, "sm_90")
    assert report.returncode == 0 and report.spilled_bytes == 0
    assert max(report.registers.values()) > report.budget
    assert report.problem is not None and "budget" in report.problem


def test_a_log_without_the_ptxas_report_fails_the_check(tmp_path: Path) -> None:
    """What --nvrtc read before it asked for the report: an empty log is not "0 spills"."""
    assert CompileReport(tmp_path / "k.cu", 0, "").problem is not None


def test_a_compile_error_fails_the_check(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cu"
    broken.write_text('#include "common.cuh"\nextern "C" __global__ void f() { undeclared(); }\n')
    report = compile_cubin(broken, "sm_90")
    assert report.returncode != 0 and "undeclared" in report.output
