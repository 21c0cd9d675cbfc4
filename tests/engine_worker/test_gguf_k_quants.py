"""K-quant GGUF tensors (Q2_K to Q6_K, what Q4_K_M and its kin hold): Q4_K's groups read exactly
as 4-bit groups, a model of every K type against transformers on the same dequantized weights,
packed by default (an IQ type is refused by name: test_validation.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.engine import Engine
from services.engine_worker.artifacts.gguf_file import GGUFArtifact
from services.engine_worker.artifacts.int4_groups import Int4Groups
from services.engine_worker.torch_backend.int4_dot import Int4DotLinear, int4_dot_is_available
from services.engine_worker.torch_backend.int8_dot import Int8DotLinear
from services.engine_worker.torch_backend.linear import Int4Linear, Int8Linear, int4_kernel_is_fast
from shared.config import CacheConfig, EngineConfig
from shared.sampling import SamplingParams
from tests.engine_worker.parity import assert_mostly_matches, kvmesh_greedy, transformers_greedy
from tests.engine_worker.test_gguf_quantized import random_k_blocks, write_gguf
from tests.model_fixtures import save_random_checkpoint

# Every K type at least once (Q6_K: the embedding), and the fallbacks a K-quant file holds where
# a row is not a multiple of 256 values; K-quants need 256 input values a row (sizes below).
K_LAYER_TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q5_K",
    "attn_v": "Q5_0",
    "attn_output": "Q3_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q2_K",
    "output": "Q5_1",
}
SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf_dir = Path(
        save_random_checkpoint(tmp_path_factory.mktemp("hf"), "llama-plain", seed=5, **SHAPES)
    )
    reference_dir = tmp_path_factory.mktemp("reference")
    target = tmp_path_factory.mktemp("gguf") / "tiny-k.gguf"
    write_gguf(hf_dir, target, reference_dir, K_LAYER_TYPES, embed_type="Q6_K")
    return target, reference_dir


def test_q4_k_groups_are_the_files_values_exactly() -> None:
    from gguf import quants

    raw = random_k_blocks((8, 512), "Q4_K", seed=0)
    groups = Int4Groups.from_blocks(raw, "Q4_K", (8, 512))
    expected = quants.dequantize(raw, quants.GGMLQuantizationType.Q4_K).reshape(8, 512)
    assert np.array_equal(groups.dequantized().numpy(), expected)
    assert int(groups.q.max()) <= 15 and groups.d.shape == (8, 16)


def test_a_k_quant_file_matches_transformers_on_the_same_weights(
    k_quant_file: tuple[Path, Path],
) -> None:
    from transformers import AutoModelForCausalLM

    target, reference_dir = k_quant_file
    artifact = GGUFArtifact(str(target))
    artifact.validate()
    assert artifact.quantization == "F32+Q2_K+Q3_K+Q4_K+Q5_0+Q5_1+Q5_K+Q6_K"
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    groups = artifact.load_int4(q_proj)  # Q rows: llama.cpp's interleave undone on the groups
    assert groups is not None and torch.equal(groups.dequantized(), artifact.load(q_proj))
    assert artifact.load_int4("model.layers.0.self_attn.k_proj.weight") is None  # Q5_K

    prompts = [[5, 9, 200, 17], list(range(3, 60)), [44] * 20, list(range(100, 300, 7))]
    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    expected = transformers_greedy(model, prompts, 16, eos=2)
    assert_mostly_matches(kvmesh_greedy(str(target), prompts, 16)[0], expected)


def test_a_k_quant_file_is_packed_by_default_q4_k_as_its_own_groups(
    k_quant_file: tuple[Path, Path],
) -> None:
    target, _ = k_quant_file
    engine = Engine(EngineConfig(model=str(target), cache=CacheConfig(kv_memory_bytes=8 << 20)))
    assert engine.manifest["weights"] == "packed"
    layer = engine.worker.runner.model.weights.layers[0]
    # gate and up are both Q4_K: their fused projection keeps the file's 4-bit groups where
    # this CPU has a fast 4-bit kernel; every other K type runs as int8 rows.
    int4, int8 = (Int4Linear, Int4DotLinear), (Int8Linear, Int8DotLinear)
    fast_int4 = int4_kernel_is_fast() or int4_dot_is_available()
    assert isinstance(layer.gate_up, int4 if fast_int4 else int8)
    assert isinstance(layer.down, int8)  # Q2_K
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[5, 9, 200, 17]], params)[0].token_ids) == 8
