"""Every way a model artifact can be wrong gives one clear ModelValidationError, naming the file,
the tensor, expected and found, before any KV memory is allocated."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine_worker.worker import Worker
from shared.config import CacheConfig, EngineConfig
from shared.errors import KvmeshError, ModelValidationError, Reason


@pytest.fixture
def llama_copy(tiny_llama_dir: str, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, target)
    return target


@pytest.fixture(autouse=True)
def forbid_kv_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation must fail before the pool exists; a test that gets this far fails loudly."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("KV cache allocated before validation finished")

    monkeypatch.setattr("services.engine_worker.torch_backend.runner.KVCache", refuse)


def load(path: Path | str) -> ModelValidationError:
    with pytest.raises(ModelValidationError) as caught:
        Worker(EngineConfig(model=str(path), cache=CacheConfig(kv_memory_bytes=8 << 20)))
    error = caught.value
    assert error.reason is Reason.INVALID_MODEL and not error.retryable
    return error


def rewrite_weights(model_dir: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    file = model_dir / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))
    return file


def test_unknown_architecture(llama_copy: Path) -> None:
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    error = load(llama_copy)
    assert "unsupported architecture" in str(error) and "GPT2LMHeadModel" in str(error)
    assert str(llama_copy / "config.json") in str(error)


def test_an_unknown_rope_scaling_is_refused(llama_copy: Path) -> None:
    """YaRN's frequencies served as another scaling's would be wrong."""
    config = json.loads((llama_copy / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (llama_copy / "config.json").write_text(json.dumps(config))
    error = load(llama_copy)
    assert "unsupported rope_type" in str(error) and error.found == "yarn"


def test_config_that_is_not_json(llama_copy: Path) -> None:
    (llama_copy / "config.json").write_text("{not json")
    assert "not valid JSON" in str(load(llama_copy))


def test_missing_config(llama_copy: Path) -> None:
    os.remove(llama_copy / "config.json")
    assert "file is missing" in str(load(llama_copy))


def test_missing_tensor(llama_copy: Path) -> None:
    rewrite_weights(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    error = load(llama_copy)
    assert error.tensor == "model.layers.1.mlp.up_proj.weight"
    assert error.expected == (192, 96) and error.found is None
    assert "missing tensor" in str(error)


def test_unexpected_tensor(llama_copy: Path) -> None:
    rewrite_weights(
        llama_copy, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    )
    error = load(llama_copy)
    assert error.tensor == "model.layers.0.mlp.extra.weight"
    assert "unexpected tensor" in str(error)


def test_shape_mismatch(llama_copy: Path) -> None:
    rewrite_weights(
        llama_copy,
        lambda t: t.update({"model.layers.2.self_attn.k_proj.weight": torch.zeros(16, 96)}),
    )
    error = load(llama_copy)
    assert error.tensor == "model.layers.2.self_attn.k_proj.weight"
    assert error.expected == (32, 96) and error.found == (16, 96)


def test_unsupported_dtype(llama_copy: Path) -> None:
    rewrite_weights(
        llama_copy, lambda t: t.update({"model.norm.weight": torch.zeros(96, dtype=torch.int8)})
    )
    error = load(llama_copy)
    assert error.tensor == "model.norm.weight" and error.found == "I8"


def test_truncated_safetensors(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as handle:
        handle.truncate(size // 2)
    error = load(llama_copy)
    assert "file is truncated" in str(error) and str(file) in str(error)
    assert error.tensor is not None


def test_corrupt_safetensors_header(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    with open(file, "r+b") as handle:
        handle.write(struct.pack("<Q", 1 << 60))
    assert "corrupt safetensors header length" in str(load(llama_copy))


def test_not_a_model_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    error = load(bogus)
    assert "not a GGUF file" in str(error) and str(bogus) in str(error)


def test_truncated_gguf(default_model_path: str, tmp_path: Path) -> None:
    broken = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as source, open(broken, "wb") as target:
        target.write(source.read(os.path.getsize(default_model_path) // 2))
    error = load(broken)
    assert str(broken) in str(error)
    assert "truncated" in str(error) or "not a readable GGUF" in str(error)


def write_tiny_gguf(path: Path, arch: str, quant_type: str, vocab: int = 0) -> None:
    """vocab: a tokenizer of that many entries (strings, scores, token types) too."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if vocab:
        writer.add_token_list([f"token-{index}" for index in range(vocab)])
        writer.add_token_scores([float(-index) for index in range(vocab)])
        writer.add_token_types([1] * vocab)
        writer.add_string("general.after_the_tokenizer", "still read")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(8)
    qtype = gguf.GGMLQuantizationType[quant_type]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((8, 256 // block_elems * block_bytes), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_gguf_quantization(tmp_path: Path) -> None:
    path = tmp_path / "iq4.gguf"
    write_tiny_gguf(path, "llama", "IQ4_XS")  # K-quants load; the IQ types do not
    error = load(path)
    assert "unsupported quantization type" in str(error)
    assert error.tensor == "model.embed_tokens.weight" and error.found == "IQ4_XS"


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, "gpt2", "Q8_0")
    error = load(path)
    assert "unsupported GGUF architecture" in str(error) and "gpt2" in str(error)


def test_gguf_missing_tensors_are_named(tmp_path: Path) -> None:
    path = tmp_path / "partial.gguf"
    write_tiny_gguf(path, "llama", "Q8_0")
    error = load(path)
    assert "missing tensor" in str(error) and error.tensor is not None


def test_long_metadata_arrays_are_read_as_their_lengths(tmp_path: Path) -> None:
    from services.engine_worker.artifacts.gguf_file import GGUFArtifact

    path = tmp_path / "vocab.gguf"
    write_tiny_gguf(path, "llama", "Q8_0", vocab=5000)
    artifact = GGUFArtifact(str(path))
    for key in ("tokens", "scores", "token_type"):
        assert len(artifact.metadata[f"tokenizer.ggml.{key}"]) == 5000
    assert artifact.metadata["general.after_the_tokenizer"] == "still read"  # offsets past them
    assert (artifact.architecture.num_layers, artifact.architecture.hidden_size) == (1, 256)


def test_kv_budget_too_small_is_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(KvmeshError) as caught:
        Worker(EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_memory_bytes=1024)))
    assert caught.value.reason is Reason.KV_CACHE_TOO_SMALL
