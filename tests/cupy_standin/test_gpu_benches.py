"""The GPU benchmarks rehearsed on the CPU stand-in for CuPy, so a GPU session spends its
minutes measuring, not finding a typo: bench-kernels' step table and bandwidth figure, and
bench-gpu's decode window with the GPU's and the host's milliseconds per step apart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.cupy_standin.conftest import SHAPE
from tests.model_fixtures import save_random_checkpoint


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # residual adds of random weights overflow
def test_bench_kernels_times_every_launch_of_a_step(standin) -> None:
    from loadtest import kernel_bench
    from services.engine_worker.cupy_backend.kernels.library import DTYPES

    spec = DTYPES["bfloat16"]
    timed = kernel_bench.step_kernels("smollm2-135m", 2, 40, spec, repeats=1)
    launches = {"input_norm", "qkv_gemm", "attention", "o_gemm", "post_norm", "gate_up_gemm"}
    assert launches | {"silu_and_mul", "down_gemm", "lm_head", "sample_tokens"} < set(timed)
    assert all(math.isfinite(value) for value in timed.values())
    micros, gb_s = kernel_bench.attention_bandwidth("smollm2-135m", 2, 300, spec, repeats=1)
    assert math.isfinite(micros) and math.isfinite(gb_s)  # figures, not a speed


def test_bench_gpu_reports_gpu_and_host_milliseconds_per_step(standin, tmp_path: Path) -> None:
    from loadtest import gpu_bench

    model = save_random_checkpoint(tmp_path, "llama", **SHAPE)
    figures, engine = gpu_bench.kvmesh_decode("cupy", "float32", 2, 8, model, 8 << 20)
    # Each figure measured (timed decode steps existed), whatever its size.
    assert all(
        isinstance(value, float) and math.isfinite(value)
        for value in (figures.tok_s, figures.gpu_ms, figures.host_ms)
    )
    timing = engine.worker.runner.timing
    assert timing is not None and any(timing.replayed)  # decode steps replayed their graph


def test_bench_gpu_writes_its_figures_for_a_shape(standin, tmp_path: Path, monkeypatch) -> None:
    """The --shape path end to end at a toy size: the random file written once, the figures
    in the JSON the GPU check's summary reads."""
    import json

    from loadtest import gpu_bench, model_shapes
    from loadtest.model_shapes import ModelShape

    toy = ModelShape(128, 2, 4, 2, 256, 49152 + 64, 2048, 500000.0)
    monkeypatch.setitem(gpu_bench.SHAPES, "llama3-8b", toy)
    monkeypatch.setattr(model_shapes, "_POOL", 1 << 16)  # random values enough for a toy
    out = tmp_path / "figures.json"
    argv = ["--shape", "llama3-8b", "--batches", "2", "--output-len", "4", "--no-llama-cpp"]
    gpu_bench.main([*argv, "--work-dir", str(tmp_path), "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["shape"] == "llama3-8b" and [r["batch"] for r in figures["rows"]] == [2]
    assert all(
        r["kvmesh_cupy"] is not None and r["cupy_gpu_ms"] is not None for r in figures["rows"]
    )
    assert (tmp_path / "llama3-8b.F16.gguf").exists()
