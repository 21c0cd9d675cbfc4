"""The model repository: entries with digests, verified at load; fixtures; capacity at load."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvmesh.cli import main
from kvmesh.mesh.settings import serving_args
from kvmesh.models_cli import record_fixtures
from services.engine_worker import worker as worker_module
from services.engine_worker.worker import Worker
from shared.config import CacheConfig, EngineConfig
from shared.errors import KvmeshError, ModelValidationError, Reason
from shared.model_entry import ModelEntry, ServingConfig, WarmupFixture, read_entry, write_entry
from shared.model_repository import ModelRepository
from shared.runtime.settings import SCHEDULER, WORKER


def _config(path: str, kv_memory_bytes: int = 8 << 20) -> EngineConfig:
    return EngineConfig(
        model=path,
        backend="torch",
        cache=CacheConfig(block_size=16, kv_memory_bytes=kv_memory_bytes),
    )


def test_add_numbers_versions_and_records_digests(tmp_path, tiny_llama_dir: str) -> None:
    repository = ModelRepository(str(tmp_path / "repo"))
    first = repository.add(
        "tiny", tiny_llama_dir, serving=ServingConfig(kv_memory="8MiB", chunk_size=64)
    )
    second = repository.add("tiny", tiny_llama_dir, aliases=("small",))
    assert (first.version, second.version) == ("1", "2")
    assert repository.names() == ["tiny"] and repository.versions("tiny") == ["1", "2"]
    assert repository.resolve("tiny").version == "2"
    assert repository.resolve("tiny@1") == read_entry(first.directory)
    entry = read_entry(first.directory)
    assert serving_args(entry, WORKER) == ["--kv-memory", "8MiB"]
    assert serving_args(entry, SCHEDULER) == ["--chunk-size", "64"]
    assert read_entry(second.directory).aliases == ("small",)
    assert any(path.endswith("model.safetensors") for path in entry.sha256)
    assert all(len(digest) == 64 for digest in entry.sha256.values())
    entry.verify()
    with pytest.raises(KvmeshError) as missing:
        repository.resolve("tiny@7")
    assert missing.value.reason is Reason.MODEL_NOT_FOUND and "1, 2" in missing.value.message
    with pytest.raises(KvmeshError):
        repository.add("../escape", tiny_llama_dir)


def _weights_file(entry_directory: str) -> str:
    entry = read_entry(entry_directory)
    name = next(p for p in entry.sha256 if p.endswith(".safetensors"))
    return os.path.join(entry.directory, name)


def test_a_corrupt_or_extra_file_never_loads(tmp_path, tiny_llama_dir: str) -> None:
    repository = ModelRepository(str(tmp_path / "repo"))
    entry = repository.add("tiny", tiny_llama_dir)
    manifest = Worker(_config(entry.directory)).manifest
    assert (manifest.model_name, manifest.version) == ("tiny", "1")
    weights = _weights_file(entry.directory)
    os.unlink(weights)  # a hard link: write a changed copy, never through the link
    with open(os.path.join(tiny_llama_dir, "model.safetensors"), "rb") as source:
        data = bytearray(source.read())
    data[-1] ^= 0xFF
    with open(weights, "wb") as target:
        target.write(data)
    with pytest.raises(ModelValidationError) as corrupt:
        Worker(_config(entry.directory))
    assert corrupt.value.reason is Reason.INVALID_MODEL
    assert "sha256 does not match" in corrupt.value.message

    other = repository.add("other", tiny_llama_dir)
    with open(os.path.join(other.directory, other.artifact, "extra.safetensors"), "wb") as extra:
        extra.write(b"swapped in")
    with pytest.raises(ModelValidationError, match="not in the entry's digests"):
        Worker(_config(other.directory))


def test_a_fixture_that_fails_refuses_the_model(tmp_path, tiny_llama_dir: str) -> None:
    entry = ModelRepository(str(tmp_path / "repo")).add("tiny", tiny_llama_dir)
    recorded = Worker(_config(entry.directory)).greedy([5, 6, 7, 8], 6)
    assert len(recorded) == 6
    good = dataclasses.replace(entry, fixtures=(WarmupFixture((5, 6, 7, 8), tuple(recorded)),))
    write_entry(good)
    assert Worker(_config(entry.directory)).manifest.version == "1"  # the same output: serves
    wrong = (*recorded[:-1], (recorded[-1] + 1) % 512)
    write_entry(dataclasses.replace(entry, fixtures=(WarmupFixture((5, 6, 7, 8), wrong),)))
    with pytest.raises(ModelValidationError, match="warm-up fixture 0 output differs"):
        Worker(_config(entry.directory))


def test_a_kv_budget_beyond_free_memory_is_refused_at_load(tiny_llama_dir: str) -> None:
    with pytest.raises(KvmeshError) as refused:
        Worker(_config(tiny_llama_dir, kv_memory_bytes=1 << 50))
    assert refused.value.reason is Reason.MODEL_DOES_NOT_FIT
    assert "MiB are free" in refused.value.message


def test_weights_that_alone_do_not_fit_are_refused_before_they_load(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for the KV pool and the workspace but not the weights: refused, and counted
    before any tensor is read (the estimate from the shapes equals what loads)."""
    import services.engine_worker.artifacts.weights as weights
    import services.engine_worker.capacity as capacity

    config = _config(tiny_llama_dir)
    loaded = Worker(config)
    arch = loaded.architecture
    assert arch.num_parameters == loaded.manifest.num_parameters
    kv = loaded.kv_shape.num_bytes(4)
    monkeypatch.setattr(capacity, "available_bytes", lambda backend: kv + (2 << 20))

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("weights were read before the fit check")

    monkeypatch.setattr(weights.ModelWeights, "build", never)
    with pytest.raises(KvmeshError) as refused:
        Worker(config)
    assert refused.value.reason is Reason.MODEL_DOES_NOT_FIT
    assert "weights" in refused.value.message and "KV cache" in refused.value.message


def test_the_parameter_estimate_matches_the_default_model(default_model_path: str) -> None:
    from services.engine_worker.artifacts.loader import open_artifact

    artifact = open_artifact(default_model_path)
    assert artifact.architecture.num_parameters == 134_515_008  # SmolLM2-135M, tied


def test_models_cli_adds_with_fixtures_and_lists(tmp_path, default_model_path: str, capsys) -> None:
    repo = str(tmp_path / "repo")
    add = ["models", "--repo", repo, "add", "smollm2", default_model_path, "--alias", "default"]
    add += ["--kv-memory", "64MiB", "--temperature", "0.5", "--fixture", "The capital of France"]
    assert main([*add, "--fixture-tokens", "4"]) == 0
    assert "added smollm2@1" in capsys.readouterr().out
    entry = ModelRepository(repo).entry("smollm2")
    assert len(entry.fixtures) == 1 and len(entry.fixtures[0].expected_ids) == 4
    assert entry.default_sampling == {"temperature": 0.5}
    worker = Worker(_config(entry.directory, 64 << 20))  # checks the fixture it just recorded
    assert worker.manifest.aliases == ("default",)
    assert main(["models", "--repo", repo, "list"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2@1" in listing and "1 fixture(s)" in listing and "aliases: default" in listing


def test_fixtures_are_recorded_in_the_formats_the_entry_serves_in(
    tmp_path, default_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fixture's tokens are exact only for the formats it was recorded in: an entry that
    serves float32 weights must not get fixtures recorded from the file's packed default."""
    serving = ServingConfig(weights="float32", kv_cache_dtype="float32", kv_memory="64MiB")
    entry = ModelRepository(str(tmp_path / "repo")).add(
        "smollm2", default_model_path, serving=serving
    )
    loaded: list[Worker] = []
    monkeypatch.setattr(
        worker_module, "Worker", lambda config: loaded.append(Worker(config)) or loaded[-1]
    )
    recorded = record_fixtures(entry, ["The capital of France"], 3)
    assert [w.manifest.weights for w in loaded] == ["float32"]
    assert loaded[0].manifest.kv_cache_dtype == "float32"
    serving_worker = Worker(
        dataclasses.replace(_config(recorded.directory, 64 << 20), weights="float32")
    )  # checks the fixture at warm-up, in the formats it serves in
    assert serving_worker.manifest.weights == "float32"


def test_a_bad_default_sampling_is_refused_when_the_entry_is_read(
    tmp_path, tiny_llama_dir: str
) -> None:
    repo = ModelRepository(str(tmp_path / "repo"))
    with pytest.raises(KvmeshError) as out_of_range:
        repo.add("tiny", tiny_llama_dir, default_sampling={"top_p": 0.0})
    assert out_of_range.value.reason is Reason.INVALID_SAMPLING_PARAMS
    assert repo.names() == []  # refused before anything was copied
    entry = repo.add("tiny", tiny_llama_dir, default_sampling={"temperature": 0.5})
    assert entry.version == "1"
    toml_path = os.path.join(entry.directory, "kvmesh.toml")
    with open(toml_path, encoding="utf-8") as handle:
        text = handle.read()
    with open(toml_path, "w", encoding="utf-8") as handle:
        handle.write(text.replace("temperature = 0.5", "temprature = 0.5"))  # a typo
    with pytest.raises(ModelValidationError) as unknown_field:
        read_entry(entry.directory)
    assert "[sampling]" in unknown_field.value.message
    assert "temprature" in unknown_field.value.message


def test_up_with_a_repository_alone_serves_every_model(tmp_path, tiny_llama_dir: str) -> None:
    from kvmesh.cli import build_parser
    from kvmesh.mesh_cli import mesh_config

    repo = ModelRepository(str(tmp_path / "repo"))
    with pytest.raises(KvmeshError) as empty:
        mesh_config(build_parser().parse_args(["up", "--model-repo", repo.root]))
    assert empty.value.reason is Reason.MODEL_NOT_FOUND
    repo.add("b", tiny_llama_dir)
    repo.add("a", tiny_llama_dir)
    config = mesh_config(build_parser().parse_args(["up", "--model-repo", repo.root]))
    assert (config.models, config.model_repo) == (["a", "b"], repo.root)
    up_b = ["up", "--model-repo", repo.root, "--models", "b"]
    chosen = mesh_config(build_parser().parse_args(up_b))
    assert chosen.models == ["b"]


def test_an_entry_names_its_weight_format_for_the_worker() -> None:
    serving = ServingConfig(
        dtype="float32", weights="packed", quantize="int8", kv_cache_dtype="float32"
    )
    entry = ModelEntry("m", "1", "/repo/m/1", "model.gguf", {}, serving)
    assert serving_args(entry, WORKER) == [
        "--dtype",
        "float32",
        "--weights",
        "packed",
        "--quantize",
        "int8",
        "--kv-cache-dtype",
        "float32",
    ]
