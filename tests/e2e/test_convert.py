"""`kvmesh convert`: the default Q4_1/Q8_0 GGUF rewritten as an F32 GGUF (llama.cpp's layout) and
as an HF safetensors directory; each loads through the real loader and answers token for token
as the original (the same weights, dequantized once)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from kvmesh.cli import main
from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig
from shared.sampling import SamplingParams

PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"token_ids": [504, 3575, 282, 4649, 314, 7, 1003, 20]},
]


def greedy(model: str | None) -> tuple[list[list[int]], dict]:
    engine = Engine(  # float32 both sides: the same weights, computed the same way
        EngineConfig(model=model, weights="float32", cache=CacheConfig(kv_memory_bytes=64 << 20))
    )
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    return [c.token_ids for c in completions], engine.manifest


def test_f32_gguf_and_safetensors_answer_as_the_original(tmp_path: Path) -> None:
    f32, directory = tmp_path / "model-f32.gguf", tmp_path / "hf"
    assert main(["convert", str(f32)]) == 0
    assert main(["convert", str(directory)]) == 0
    reader = gguf.GGUFReader(str(f32))
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert reader.fields["tokenizer.chat_template"].contents()  # metadata carried over
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    original, manifest = greedy(None)
    assert "Q4_1" in manifest["quantization"]
    for converted in (str(f32), str(directory)):
        tokens, converted_manifest = greedy(converted)
        assert converted_manifest["quantization"] in ("F32", "none")
        assert tokens == original


@pytest.mark.parametrize("kind", ["qwen3", "phi3"])
def test_a_directory_of_another_family_reads_as_its_own(kind: str, tmp_path: Path) -> None:
    """Qwen3's Q/K norms and Phi-3's fused projections under their own model_type: kvmesh and
    transformers read the written directory as the original."""
    from kvmesh.convert import to_safetensors
    from tests.engine_worker.parity import (
        assert_mostly_matches,
        hf_model,
        kvmesh_greedy,
        transformers_greedy,
    )
    from tests.model_fixtures import save_random_checkpoint

    original = save_random_checkpoint(tmp_path / "hf", kind)
    to_safetensors(original, str(tmp_path / "out"))
    prompts = [[5, 9, 200, 17], list(range(3, 60))]
    theirs, _ = kvmesh_greedy(original, prompts, 8)
    ours, _ = kvmesh_greedy(str(tmp_path / "out"), prompts, 8)
    assert [g.tokens for g in ours] == [g.tokens for g in theirs]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == kind
    assert_mostly_matches(
        ours, transformers_greedy(hf_model(str(tmp_path / "out")), prompts, 8, eos=2)
    )
