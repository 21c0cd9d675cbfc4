"""The GPU check's CPU-side parts: the default model's skeleton and the random-weight model
written from it load as the default model does, the script parses, and the summary reads a
check's output folder. (The run itself: `KVMESH_CUPY_STANDIN=1 make gpu-check` rehearses it.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf

from services.engine_worker.artifacts.loader import open_artifact
from tests.gpu.check import model_skeleton, summary

CHECK = Path(__file__).resolve().parent


def test_a_random_model_from_the_skeleton_loads_as_the_default_model(
    default_model_path: str, tmp_path: Path
) -> None:
    skeleton, random = tmp_path / "skeleton.gguf", tmp_path / "random.gguf"
    model_skeleton.write_skeleton(default_model_path, str(skeleton))
    assert skeleton.stat().st_size < 3 << 20  # metadata only: it travels to the GPU machine
    model_skeleton.write_random(str(skeleton), str(random))
    default, written = open_artifact(default_model_path), open_artifact(str(random))
    written.validate()
    assert written.architecture == default.architecture
    assert written.quantization == default.quantization

    def tensors(path: str) -> list[tuple]:
        return [(t.name, t.shape.tolist(), t.tensor_type) for t in gguf.GGUFReader(path).tensors]

    assert tensors(str(random)) == tensors(default_model_path)
    original = gguf.GGUFReader(default_model_path).fields
    assert original["tokenizer.ggml.tokens"].contents() == (
        gguf.GGUFReader(str(random)).fields["tokenizer.ggml.tokens"].contents()
    )


def test_the_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(CHECK / "run.sh")], check=True)


def test_the_summary_reads_a_check_folder(tmp_path: Path) -> None:
    (tmp_path / "gpu.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.1\n")
    (tmp_path / "results.txt").write_text("install rc=0 seconds=12\nsuite rc=1 seconds=80\n")
    (tmp_path / "suite.xml").write_text(
        '<testsuites><testsuite tests="2" failures="1" errors="0" skipped="0" time="80.1">'
        '<testcase classname="tests.gpu.test_kernels" name="test_ok"/>'
        '<testcase classname="tests.gpu.test_kernels" name="test_bad">'
        '<failure message="assert 1 == 2"/></testcase></testsuite></testsuites>'
    )
    (tmp_path / "manifest.log").write_text(
        "loading\n" + json.dumps({"cuda_graphs": {"1": "graph"}}, indent=2)
    )
    (tmp_path / "mesh.log").write_text("kvmesh: ready\nThe sky is blue because...\n")
    rows = [
        {"batch": 1, "kvmesh_cupy": 1500.0, "llama_cpp_F16": 900.0, "llama_cpp_Q4_1": None,
         "cupy_gpu_ms": 0.41234, "cupy_host_ms": 0.25}
    ]  # fmt: skip
    (tmp_path / "bench-gpu.json").write_text(
        json.dumps(
            {"device": "H100", "dtype": "bfloat16", "prompt_len": 128, "output_len": 128,
             "rows": rows}
        )
    )  # fmt: skip
    ceiling = "http  128 streams:    60000 tok/s (1.0 a delta); ... ITL p50 2.10 ms, p99 3.90 ms"
    (tmp_path / "meshceiling.log").write_text(ceiling + "\n")
    page = summary.render(tmp_path)
    assert "NVIDIA H100" in page
    assert ceiling in page
    assert "| suite | 1 | 80 |" in page
    assert "2 tests, 1 failed" in page and "test_bad: assert 1 == 2" in page
    assert '{"1": "graph"}' in page
    assert "The sky is blue" in page
    assert "| 1 | 1500 | 900 | - | 0.412 | 0.250 | 1.67x (1.3x) |" in page
