"""Prepared artifacts: a worker prepares a model once and stores it; the next loads it, with no
packing or tracing, and computes the same bits; an artifact made for another runtime is not
used (the manifest says why) and one whose bytes changed is refused.

A tiny Qwen2 checkpoint quantized to packed weights at load; the compiled step in one test
(two processes: the programs are loaded where nothing traced them, Dynamo not even imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.cli import main
from services.engine_worker.prepared_artifact import MANIFEST, PreparedKey, PreparedStore
from services.engine_worker.server import model_info
from services.engine_worker.worker import Worker
from shared.config import EngineConfig
from shared.errors import ModelValidationError, Reason
from shared.model_entry import read_entry

PROMPTS = ([3, 17, 42, 5, 9, 11, 2, 8, 30, 31, 7, 6, 1, 4, 12, 13, 19, 21], [50, 51, 52])

# A worker in its own process: how it was made ready, then greedy tokens and their logprobs.
SERVE = """
import json, sys
from services.engine_worker.worker import Worker
from shared.config import CacheConfig, EngineConfig
background = sys.argv[5] == "background"  # as a served worker: eager steps while it compiles
worker = Worker(EngineConfig(model=sys.argv[1], quantize="int4", compile=sys.argv[2],
                             prepared="auto", cache=CacheConfig(kv_memory_bytes=int(sys.argv[4]))),
                background)

def outputs():
    found = []
    for prompt in json.loads(sys.argv[3]):
        tokens = worker.greedy(prompt, 6)
        scores = worker.prompt_log_softmax(prompt + tokens)
        found.append([tokens, scores[len(prompt) - 1 :].max(dim=-1).values.tolist()])
    return found

eager = {}
if background:
    eager = {"source": worker.manifest.preparation["source"], "kv_blocks": worker.num_kv_blocks,
             "outputs": outputs()}
    worker.pending_preparation.wait()
    worker.finish_preparation()
result = outputs()
dynamo = "torch._dynamo.convert_frame" in sys.modules
print(json.dumps({"preparation": worker.manifest.preparation, "outputs": result,
                  "dynamo": dynamo, "eager": eager, "pool_blocks": worker.kv_shape.num_blocks}))
"""


def serve_in_processes(
    model: str,
    compile: str,
    cache: Path,
    count: int = 1,
    kv_memory: int = 64 << 20,
    mode: str = "wait",
) -> list[dict[str, Any]]:
    # A loaded program checks its inputs' shapes against those it was compiled for: one fixed
    # by mistake fails the step with an error instead of reading out of bounds.
    env = {**os.environ, "KVMESH_CACHE_DIR": str(cache), "AOTI_RUNTIME_CHECK_INPUTS": "1"}
    prompts = json.dumps(PROMPTS)
    args = [sys.executable, "-c", SERVE, model, compile, prompts, str(kv_memory), mode]
    processes = [
        subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True) for _ in range(count)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes)
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def worker(model: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Worker:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(cache))
    return Worker(EngineConfig(model=model, quantize="int4", compile="off", prepared="auto"))


def stored(cache: Path) -> list[Path]:
    return sorted(path.parent for path in (cache / "prepared").glob(f"*/{MANIFEST}"))


def test_a_prepared_compiled_model_loads_elsewhere_with_the_same_bits(
    tiny_qwen2_dir: str, tmp_path: Path
) -> None:
    # Another --kv-memory: the programs take the pool's block count as a size of their own,
    # the decode program as the prefill one (their input checks are on: serve_in_processes).
    # The first as a served worker prepares: eager steps until its programs have compiled.
    (first,) = serve_in_processes(tiny_qwen2_dir, "auto", tmp_path, 1, 2 << 20, "background")
    (second,) = serve_in_processes(tiny_qwen2_dir, "auto", tmp_path, kv_memory=6 << 20)
    eager = first["eager"]
    assert eager["source"] == "preparing" and len(eager["outputs"]) == len(PROMPTS)
    assert eager["kv_blocks"] < first["pool_blocks"]  # the fixture's blocks kept from requests
    prepared, loaded = first["preparation"], second["preparation"]
    assert (prepared["source"], loaded["source"]) == ("prepared", "loaded")
    assert prepared["id"] == loaded["id"] and prepared["phases"]["compile"] > 0
    assert loaded["phases"]["compile"] == 0 and loaded["phases"]["prepare"] == 0
    programs = os.listdir(Path(loaded["directory"]) / "programs")
    assert {"step-prefill.pt2", "step-decode.pt2"} <= set(programs)
    assert second["outputs"] == first["outputs"]  # tokens and logprobs, bit for bit
    assert first["dynamo"] and not second["dynamo"]  # loaded, nothing traced or imported


@pytest.mark.parametrize(
    ("field", "other"), [("torch", "2.0.0"), ("cpu", "riscv64 RVV"), ("weights", "float32")]
)
def test_an_artifact_for_another_runtime_is_refused_and_prepared_anew(
    tiny_qwen2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, other: str
) -> None:
    first = worker(tiny_qwen2_dir, tmp_path, monkeypatch)
    assert first.manifest.preparation["source"] == "prepared"
    (directory,) = stored(tmp_path)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["key"][field] = other
    (directory / MANIFEST).write_text(json.dumps(manifest))
    again = worker(tiny_qwen2_dir, tmp_path, monkeypatch).manifest.preparation
    assert again["source"] == "prepared"
    assert f"{field}: {other!r} != " in again["mismatch"]
    assert stored(tmp_path) == [directory]  # replaced in place
    assert worker(tiny_qwen2_dir, tmp_path, monkeypatch).manifest.preparation["source"] == "loaded"


def test_a_flipped_byte_fails_its_digest_and_never_serves(
    tiny_qwen2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker(tiny_qwen2_dir, tmp_path, monkeypatch)
    (directory,) = stored(tmp_path)
    weights = directory / "weights.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelValidationError) as refused:
        worker(tiny_qwen2_dir, tmp_path, monkeypatch)
    assert refused.value.reason is Reason.INVALID_MODEL
    assert "weights.pt does not match its digest" in refused.value.message


def test_two_workers_racing_on_one_key_prepare_it_once(tiny_qwen2_dir: str, tmp_path: Path) -> None:
    outcomes = serve_in_processes(tiny_qwen2_dir, "off", tmp_path, count=2)
    sources = sorted(outcome["preparation"]["source"] for outcome in outcomes)
    assert sources == ["loaded", "prepared"]  # the second waited for the first, then loaded
    assert len(stored(tmp_path)) == 1
    assert not [p for p in (tmp_path / "prepared").iterdir() if p.name.endswith(".tmp")]
    assert outcomes[0]["outputs"] == outcomes[1]["outputs"]


def test_off_stores_nothing(tiny_qwen2_dir: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    loaded = Worker(EngineConfig(model=tiny_qwen2_dir, quantize="int4", prepared="off"))
    assert loaded.manifest.preparation["source"] == "off"
    assert not (tmp_path / "prepared").exists()


def test_models_add_prepares_the_version_its_workers_load(
    default_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVMESH_PREPARED", "auto")
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "models"
    assert main(["models", "--repo", str(repo), "add", "smol", default_model_path]) == 0
    entry = read_entry(str(repo / "smol" / "1"))
    assert entry.prepared and (repo / "smol" / "1" / "prepared" / entry.prepared).is_dir()
    served = Worker(EngineConfig(model=entry.directory, prepared="auto"))
    assert served.manifest.preparation["source"] == "loaded"
    assert served.manifest.preparation["id"] == entry.prepared
    assert model_info(served).prepared_id == entry.prepared  # what execution records carry
    assert not (tmp_path / "cache" / "prepared").exists()  # the version's own folder served


def test_kvmesh_prepare_writes_where_out_says_and_a_worker_there_loads_it(
    tiny_qwen2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "prepared"
    args = ["prepare", tiny_qwen2_dir, "--quantize", "int4", "--compile", "off"]
    assert main([*args, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"] == "prepared" and (out / printed["id"] / MANIFEST).is_file()
    config = EngineConfig(
        model=tiny_qwen2_dir, quantize="int4", compile="off", prepared="auto", prepared_dir=str(out)
    )
    assert Worker(config).manifest.preparation["directory"] == str(out / printed["id"])
    assert not (tmp_path / "cache" / "prepared").exists()


def test_a_killed_starts_staging_folder_goes_with_the_next_preparation(tmp_path: Path) -> None:
    key, other = (
        PreparedKey(*["x"] * 9, "packed", "float32", "float32", 16, compiled)
        for compiled in (True, False)
    )
    store = PreparedStore([tmp_path])
    killed = tmp_path / f".{key.id}.4242.tmp"  # a SIGKILLed worker's, pid long gone
    (killed / "programs").mkdir(parents=True)
    preparing_other = tmp_path / f".{other.id}.4243.tmp"  # another key: its own lock
    preparing_other.mkdir()
    with store.locked(key):
        staging = store.begin(key)
    assert staging.is_dir() and not killed.exists() and preparing_other.is_dir()
