"""4-bit packed weights: a Q4 file's own groups read exactly, run by torch's int4 CPU kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.engine import Engine
from services.engine_worker.artifacts.gguf_file import GGUFArtifact
from services.engine_worker.artifacts.int4_groups import Int4Groups
from services.engine_worker.config import build_parser, engine_config
from services.engine_worker.torch_backend import graph_ops  # noqa: F401 (kvmesh:: ops)
from services.engine_worker.torch_backend import weights as torch_weights
from services.engine_worker.torch_backend.int4_dot import Int4DotLinear, int4_dot_is_available
from services.engine_worker.torch_backend.int8_dot import Int8DotLinear, int8_dot_is_available
from services.engine_worker.torch_backend.linear import (
    Int4Linear,
    Int8Linear,
    dense_prefill_is_fast,
    int4_kernel_is_fast,
)
from services.engine_worker.torch_backend.weights import resolve_weight_format
from shared.config import CacheConfig, EngineConfig
from shared.runtime.settings import SettingError
from shared.sampling import SamplingParams
from tests.engine_worker.test_gguf_quantized import LAYER_TYPES, write_gguf
from tests.model_fixtures import save_random_checkpoint

needs_int4_kernel = pytest.mark.skipif(
    not int4_kernel_is_fast(), reason="torch's int4 CPU kernel is vectorized for AVX-512 only"
)


@pytest.fixture(scope="module")
def q4_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The random Llama checkpoint as all-Q4_0 and all-Q4_1 GGUFs (Q8_0 embedding and head)."""
    hf_dir = Path(save_random_checkpoint(tmp_path_factory.mktemp("hf"), "llama-plain", seed=11))
    files = {}
    for kind in ("Q4_0", "Q4_1"):
        files[kind] = tmp_path_factory.mktemp(kind) / f"tiny-{kind}.gguf"
        write_gguf(
            hf_dir, files[kind], tmp_path_factory.mktemp("ref"), dict.fromkeys(LAYER_TYPES, kind)
        )
    return files


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_files_4bit_groups_are_read_exactly(kind: str, q4_files: dict[str, Path]) -> None:
    artifact = GGUFArtifact(str(q4_files[kind]))
    layer_tensors = [n for n in artifact.tensors if n.startswith("model.layers.0.")]
    checked = 0
    for name in layer_tensors:
        groups = artifact.load_int4(name)
        if name.endswith("norm.weight"):
            assert groups is None  # F32: no groups
            continue
        assert groups is not None
        # Q and K rows included: llama.cpp's interleave is undone on the nibbles and pairs.
        assert torch.equal(groups.dequantized(), artifact.load(name)), name
        assert int(groups.q.max()) <= 15
        checked += 1
    assert checked == 7
    assert artifact.load_int4("model.embed_tokens.weight") is None  # Q8_0


def test_the_q4_1_recipe_reproduces_a_q4_1_files_groups(q4_files: dict[str, Path]) -> None:
    """`--quantize int4` quantizes as llama.cpp's Q4_1 does: a Q4_1 file's dequantized weights
    quantize back to the file's own nibbles and pairs."""
    artifact = GGUFArtifact(str(q4_files["Q4_1"]))
    name = "model.layers.1.mlp.down_proj.weight"
    own = artifact.load_int4(name)
    assert own is not None
    again = Int4Groups.quantize(artifact.load(name))
    assert torch.equal(again.q, own.q)
    assert torch.equal(again.dequantized(), own.dequantized())


@needs_int4_kernel
def test_an_int4_row_is_computed_the_same_whatever_its_batch() -> None:
    torch.manual_seed(0)
    projection = Int4Linear(Int4Groups.quantize(torch.randn(96, 128) * 0.05), torch.randn(96))
    rows = torch.randn(40, 128)
    rows[3] *= 100
    together = projection(rows)
    alone = torch.cat([projection(rows[i : i + 1]) for i in range(40)])
    assert torch.equal(together, alone)
    assert torch.equal(projection(rows[5:13]), together[5:13])


@needs_int4_kernel
def test_an_int4_projection_computes_its_dequantized_weight() -> None:
    torch.manual_seed(1)
    groups = Int4Groups.quantize(torch.randn(256, 128) * 0.02)
    x = torch.randn(4, 128)
    out = Int4Linear(groups)(x)
    reference = x.bfloat16().float() @ Int4Linear.dequantized(groups).t()
    # What is left is the kernel's float32 summation order and its bfloat16 output.
    assert ((out - reference).norm() / reference.norm()).item() < 0.01
    assert ((reference - x @ groups.dequantized().t()).norm() / reference.norm()).item() < 0.01


@needs_int4_kernel
@pytest.mark.parametrize("out_features", [64, 80, 96, 176, 576])  # 64-row blocks, a last smaller
def test_the_dense_weight_unpacks_the_kernels_own_packing(out_features: int) -> None:
    """Prefill rows multiply `dense_weight`, unpacked from the 4-bit kernel's packing: it must
    be the weight that kernel computes with, each value rounded to bfloat16."""
    torch.manual_seed(out_features)
    groups = Int4Groups.quantize(torch.randn(out_features, 128) * 0.02)
    projection = Int4Linear(groups)
    scale, zero = projection._scale_zero.unbind(-1)
    dense = Int4Linear.dense_weight(projection._packed, scale.contiguous(), zero.contiguous())
    assert dense.dtype == torch.bfloat16 and dense.shape == (128, out_features)
    assert torch.equal(dense, Int4Linear.dequantized(groups).t().bfloat16())


@pytest.mark.skipif(not dense_prefill_is_fast(), reason="no bfloat16 GEMMs in hardware")
def test_a_dense_prefill_row_is_computed_the_same_whatever_its_batch() -> None:
    """`kvmesh::int4_rows`: decode rows through the 4-bit kernel, prefill rows dense, and a
    prompt token's row must not depend on how many share its step (a cached prefix's prefill
    against a cold one). oneDNN picks its bfloat16 kernel by the row count: without AMX a lone
    row was summed in another order at this width, with AMX 65 to 341 rows were (both failed
    here before rows went in fixed pieces)."""
    torch.manual_seed(2)
    projection = Int4Linear(Int4Groups.quantize(torch.randn(576, 1536) * 0.02))
    assert projection.dense_parts is not None
    rows = torch.randn(400, 1536).bfloat16()
    packed, scale_zero = projection._packed, projection._scale_zero
    weight = Int4Linear.dense_weight(packed, *projection.dense_parts)

    def int4_rows(rows: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return torch.ops.kvmesh.int4_rows(rows, decodes, packed, scale_zero, weight)

    together = int4_rows(rows)
    assert torch.equal(torch.cat([int4_rows(rows[i : i + 1]) for i in range(64)]), together[:64])
    for start, count in ((5, 2), (16, 40), (63, 1), (100, 150), (30, 300), (0, 257)):
        assert torch.equal(int4_rows(rows[start : start + count]), together[start : start + count])
    dense = rows.float() @ weight.float()
    assert ((together.float() - dense).norm() / dense.norm()).item() < 0.01
    mixed = int4_rows(rows, 10)
    assert torch.equal(mixed[:10], projection.product(rows[:10], packed, scale_zero))
    assert torch.equal(mixed[10:], together[10:])
    assert torch.equal(int4_rows(rows[:64], 64), projection.product(rows[:64], packed, scale_zero))


@pytest.mark.skipif(
    not (int4_kernel_is_fast() or int4_dot_is_available()), reason="no fast 4-bit kernel here"
)
def test_a_q4_file_runs_its_projections_as_int4_and_is_packed_by_default(
    q4_files: dict[str, Path],
) -> None:
    engine = Engine(
        EngineConfig(model=str(q4_files["Q4_1"]), cache=CacheConfig(kv_memory_bytes=8 << 20))
    )
    assert engine.manifest["weights"] == "packed"
    layer = engine.worker.runner.model.weights.layers[0]
    kind = Int4DotLinear if int4_dot_is_available() else Int4Linear
    assert all(isinstance(p, kind) for p in (layer.qkv, layer.o_proj, layer.gate_up))
    # A Q8_0 head has no 4-bit groups: int8 rows (through our kernel where there is VNNI).
    head_kind = Int8DotLinear if int8_dot_is_available() else Int8Linear
    assert isinstance(engine.worker.runner.model.weights.lm_head, head_kind)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[5, 9, 200, 17]], params)[0].token_ids) == 6


@pytest.mark.parametrize("ours", [True, False])
def test_without_torchs_fast_int4_kernel_packed_runs_ours_or_int8_rows(
    ours: bool, q4_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an AVX2 CPU does: torch's int4 kernel is not vectorized there (17x slower than an
    fp32 GEMM, measured on Zen 1), so a Q4 file's packed projections run `kvmesh::int4_dot`
    (its AVX2 build), or int8 rows where that did not build."""
    if ours and not int4_dot_is_available():
        pytest.skip("kvmesh::int4_dot did not build here")
    monkeypatch.setattr(torch_weights, "int4_kernel_is_fast", lambda: False)
    if not ours:
        monkeypatch.setattr(torch_weights, "int4_dot_is_available", lambda: False)
    engine = Engine(
        EngineConfig(model=str(q4_files["Q4_0"]), cache=CacheConfig(kv_memory_bytes=8 << 20))
    )
    assert engine.manifest["weights"] == "packed"
    layer = engine.worker.runner.model.weights.layers[0]
    kind = Int4DotLinear if ours else (Int8Linear, Int8DotLinear)
    assert all(isinstance(p, kind) for p in (layer.qkv, layer.o_proj, layer.down))


def test_quantize_int4_is_a_flag_the_engine_takes() -> None:
    parser = build_parser()
    config = engine_config(parser.parse_args(["--quantize", "int4"]))
    assert config.quantize == "int4" and config.weights == "auto"
    with pytest.raises(SettingError):
        parser.parse_args(["--quantize", "int2"])


def test_auto_weights_follow_the_files_quantization() -> None:
    assert resolve_weight_format("auto", None, "F32+Q4_1+Q8_0") == "packed"
    assert resolve_weight_format("auto", None, "F32+Q4_0") == "packed"
    assert resolve_weight_format("auto", None, "F32+Q8_0") == "packed"
    assert resolve_weight_format("auto", None, "F16+F32") == "float32"
    assert resolve_weight_format("auto", "int4", "F32") == "packed"
    assert resolve_weight_format("float32", None, "F32+Q4_1") == "float32"


@pytest.mark.parametrize("kernel", ["int4_dot", "int4", "int8_dot", "int8"])
def test_a_prefill_over_cached_blocks_gives_a_cold_prefills_bits(
    kernel: str, default_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same seed, same answer across prefix-cache states: the second run of each prompt
    prefills over its cached whole blocks and must give the first run's logprobs bit for bit
    (packed activations are rounded, so a float-level difference in attention would show: one
    SDPA call over all of a prefill's queries failed this at 18 tokens, 16 of them cached, and
    a prompt's last token computed alone as a decode failed it at 33)."""
    if kernel == "int4_dot" and not int4_dot_is_available():
        pytest.skip("kvmesh::int4_dot needs AVX512-VNNI")
    if kernel == "int4" and not int4_kernel_is_fast():
        pytest.skip("torch's int4 CPU kernel is vectorized for AVX-512 only")
    if kernel == "int8_dot" and not int8_dot_is_available():
        pytest.skip("kvmesh::int8_dot needs AVX512-VNNI")
    if kernel != "int4_dot":
        monkeypatch.setattr(torch_weights, "int4_dot_is_available", lambda: False)
    if kernel.startswith("int8"):  # int8 rows throughout
        monkeypatch.setattr(torch_weights, "int4_kernel_is_fast", lambda: False)
    if kernel == "int8":  # through fbgemm (no VNNI), the head too
        monkeypatch.setattr(torch_weights, "int8_dot_is_available", lambda: False)
    engine = Engine(EngineConfig(cache=CacheConfig(kv_memory_bytes=64 << 20)))
    assert engine.manifest["weights"] == "packed"
    layer = engine.worker.runner.model.weights.layers[0]
    kinds = {
        "int4_dot": Int4DotLinear,
        "int4": Int4Linear,
        "int8_dot": Int8DotLinear,
        "int8": Int8Linear,
    }
    assert isinstance(layer.down, kinds[kernel])
    assert_cached_prefills_give_cold_bits(engine)


def assert_cached_prefills_give_cold_bits(engine: Engine) -> None:
    """Each prompt twice with one seed: the second run prefills over the first's cached whole
    blocks and must give its tokens and logprobs bit for bit."""
    for length in (18, 21, 33, 47):  # 16 or 32 tokens cached, then 1 to 15 computed
        prompt = [(977 * i + length) % 20000 + 100 for i in range(length)]
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=length, logprobs=2)
        cold, cached = (engine.generate([prompt], params)[0] for _ in range(2))
        assert cached.cached_tokens >= 16 and cold.cached_tokens == 0
        assert cached.token_ids == cold.token_ids
        assert [lp.top for lp in cached.logprobs] == [lp.top for lp in cold.logprobs], length
