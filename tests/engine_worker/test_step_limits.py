"""The compiled step under any step limits: a one-row engine with a small token budget and one
with the defaults each prepare it from an empty cache and decode the same greedy tokens; an
artifact serves other limits (one row, a small budget) only where export proved its programs
take any size; a compiler failure names the limits and the way out.

A one-row engine's warm-up prefill has no decode row, and that size of 0, taken as the
compiler's hint, broke Inductor (`ZeroDivisionError` laying out the output). The programs are
now exported for a batch of their own (GraphBatch.export_example). A random Qwen2 quantized at
load, each engine in a process of its own (nothing compiled in one reaches the next)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.engine_worker import step_formats
from services.engine_worker.prepared_artifact import MANIFEST
from services.engine_worker.torch_backend import saved_programs
from services.engine_worker.torch_backend.saved_programs import StepCompileError
from services.engine_worker.worker import Worker
from shared.config import EngineConfig, SchedulerConfig

pytestmark = pytest.mark.skipif(
    not step_formats.has_cpp_compiler(), reason="inductor needs a C++ compiler"
)

PROMPTS = [[3, 17, 42, 5, 9, 11, 2, 8, 30, 31, 7, 6, 1, 4, 12, 13, 19, 21, 22, 23], [50, 51, 52]]
DEFAULTS = SchedulerConfig()

# An in-process engine under the given step limits, prepared (or loaded) as a user's would be.
SERVE = """
import json, sys
from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.sampling import SamplingParams
tokens, seqs = int(sys.argv[2]), int(sys.argv[3])
engine = Engine(EngineConfig(model=sys.argv[1], quantize="int4", compile="auto", prepared="auto",
                             scheduler=SchedulerConfig(max_num_batched_tokens=tokens,
                                                       max_num_seqs=seqs),
                             cache=CacheConfig(kv_memory_bytes=8 << 20)))
done = engine.generate(json.loads(sys.argv[4]), SamplingParams(max_tokens=8, temperature=0.0))
programs = engine.worker.runner.compiled.programs
print(json.dumps({"preparation": engine.manifest["preparation"],
                  "programs": sorted(programs.programs), "eager": programs.eager_fallback,
                  "outputs": [completion.token_ids for completion in done]}))
"""


def serve(model: str, cache: Path, tokens: int, seqs: int) -> dict[str, Any]:
    # A loaded program checks its inputs against the sizes it was compiled for.
    env = {**os.environ, "KVMESH_CACHE_DIR": str(cache), "AOTI_RUNTIME_CHECK_INPUTS": "1"}
    args = [sys.executable, "-c", SERVE, model, str(tokens), str(seqs), json.dumps(PROMPTS)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def manifest_of(preparation: dict[str, Any]) -> dict[str, Any]:
    return json.loads((Path(preparation["directory"]) / MANIFEST).read_text())


@pytest.fixture(scope="module")
def under_defaults(
    tiny_qwen2_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    """The default limits' engine, prepared from an empty cache: that cache and its run."""
    cache = tmp_path_factory.mktemp("defaults")
    run = serve(tiny_qwen2_dir, cache, DEFAULTS.max_num_batched_tokens, DEFAULTS.max_num_seqs)
    assert run["preparation"]["source"] == "prepared" and not run["eager"]
    return cache, run


def test_a_one_row_engine_with_a_small_token_budget_prepares_with_the_defaults_tokens(
    tiny_qwen2_dir: str, tmp_path: Path, under_defaults: tuple[Path, dict[str, Any]]
) -> None:
    _, defaults = under_defaults
    small = serve(tiny_qwen2_dir, tmp_path, 512, 1)
    assert small["preparation"]["source"] == "prepared"  # from an empty cache
    assert small["programs"] == ["step-decode", "step-prefill"] and not small["eager"]
    manifest = manifest_of(small["preparation"])
    assert manifest["step_limits"]["max_num_seqs"] == 1
    assert manifest["step_limits"]["max_num_batched_tokens"] == 512
    assert manifest["programs_take_any_size"]
    assert small["outputs"] == defaults["outputs"]


@pytest.mark.parametrize(
    ("tokens", "seqs"), [(2048, 1), (512, 128)], ids=["max_num_seqs=1", "batched_tokens=512"]
)
def test_an_artifact_whose_programs_take_any_size_serves_other_step_limits(
    tiny_qwen2_dir: str, under_defaults: tuple[Path, dict[str, Any]], tokens: int, seqs: int
) -> None:
    cache, defaults = under_defaults
    assert manifest_of(defaults["preparation"])["programs_take_any_size"]
    other = serve(tiny_qwen2_dir, cache, tokens, seqs)
    assert other["preparation"]["source"] == "loaded"
    assert other["preparation"]["id"] == defaults["preparation"]["id"]
    assert other["programs"] == ["step-decode", "step-prefill"] and not other["eager"]
    assert other["outputs"] == defaults["outputs"]


def test_an_artifact_with_programs_fixed_to_its_sizes_serves_only_its_own_limits(
    tiny_qwen2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))

    def worker(seqs: int) -> Worker:
        limits = SchedulerConfig(max_num_seqs=seqs)
        return Worker(
            EngineConfig(
                model=tiny_qwen2_dir,
                quantize="int4",
                compile="off",
                prepared="auto",
                scheduler=limits,
            )
        )

    first = worker(4).manifest.preparation
    path = Path(first["directory"]) / MANIFEST
    manifest = json.loads(path.read_text())
    assert manifest["step_limits"]["max_num_seqs"] == 4
    manifest["programs_take_any_size"] = False  # as if export had fixed a size
    path.write_text(json.dumps(manifest))
    assert worker(4).manifest.preparation["source"] == "loaded"  # its own limits
    other = worker(1).manifest.preparation
    assert other["source"] == "prepared"
    assert "step_limits: " in other["mismatch"] and "'max_num_seqs': 1" in other["mismatch"]


def test_a_compiler_failure_names_the_step_limits_and_the_way_out(
    tiny_qwen2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FailingCompile:
        """The compiler's child as it failed on a one-row engine's prefill program."""

        takes_any_size = True

        def __init__(self, function: object, example: object, package: Path, options: object):
            self.package = package

        def wait(self) -> None:
            raise StepCompileError(
                f"compiling {self.package.name} failed: ZeroDivisionError: integer modulo by zero"
            )

        def kill(self) -> None:
            pass

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(saved_programs, "_Compiling", FailingCompile)
    limits = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=1)
    config = EngineConfig(
        model=tiny_qwen2_dir, quantize="int4", compile="auto", prepared="wait", scheduler=limits
    )
    with pytest.raises(StepCompileError) as failed:
        Worker(config)
    message = str(failed.value)
    assert "max_num_batched_tokens=512, max_num_seqs=1" in message
    assert "compile='off'" in message and "integer modulo by zero" in message
    assert not list((tmp_path / "prepared").glob(f"*/{MANIFEST}"))  # nothing stored
    assert not [p for p in (tmp_path / "prepared").iterdir() if p.name.endswith(".tmp")]
