"""The packed model's compiled graphs (compiled_model.py), on the default model and a random
Qwen2 (q/k/v biases) quantized at load: the graphs warm-up compiles (one for steps with prefill
rows, one without) serve every kind of step, greedy output against float32 by the near-tie
rule, and the row-exactness the eager packed path has: a row's bits do not depend on its batch,
on a cached prefix, or on drafts verified beside it.

The default model's projections run as 4-bit groups on AVX-512 CPUs and as int8 rows
(fbgemm, through `kvmesh::int8_rows`) on AVX2 ones; the Qwen2 test runs both forms on any CPU
that has them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvmesh.engine import Engine
from loadtest.perplexity import SHIPPED_TEXT, perplexity, text_token_ids
from services.engine_worker import step_formats
from services.engine_worker.torch_backend import compiled_model, graph_ops
from services.engine_worker.torch_backend.graph_ops import int8_handle, int8_projection
from services.engine_worker.torch_backend.int4_dot import (
    Int4DotLinear,
    int4_dot_is_available,
    prefill_rows_dense,
)
from services.engine_worker.torch_backend.int8_dot import Int8DotLinear
from services.engine_worker.torch_backend.linear import (
    Int4Linear,
    Int8Linear,
    int4_kernel_is_fast,
)
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.engine_worker.parity import QUESTIONS, compare
from tests.engine_worker.test_int4_weights import assert_cached_prefills_give_cold_bits
from tests.engine_worker.test_speculative import COPY_PROMPT, run, speculating
from tests.engine_worker.test_weight_formats import greedy_runs

pytestmark = pytest.mark.skipif(
    not step_formats.has_cpp_compiler(), reason="inductor needs a C++ compiler"
)
# Prompts arrive over several steps, prefill chunks share steps with decodes.
BATCHING = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, prefill_chunk_size=16)


def load(model: str | None, compile: str, **overrides: object) -> Engine:
    cache = CacheConfig(kv_memory_bytes=128 << 20)  # the perplexity text's ~2k tokens fit
    config = EngineConfig(model=model, compile=compile, cache=cache, **overrides)  # type: ignore[arg-type]
    return Engine(config)


GRAPHS_AT_START: list[int] = []  # graphs compiled in this process once the fixture warmed up


@pytest.fixture(scope="module")
def compiled(default_model_path: str) -> Iterator[Engine]:
    engine = load(None, "auto", scheduler=BATCHING)
    assert engine.manifest["weights"] == "packed" and engine.manifest["compiled"]
    assert engine.worker.runner.compiled is not None
    # Where its warm-up compiled or loaded the step (0 and 0 when this process had it already).
    cache = engine.manifest["compile_cache"]
    assert Path(cache["directory"]).is_dir() and {"hits", "misses"} <= cache.keys()
    GRAPHS_AT_START.append(graphs_compiled())
    yield engine


def graphs_compiled() -> int:
    """The step's graphs."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(compiled_model._graph.__code__))


def test_compile_is_off_where_asked_and_for_float_weights(default_model_path: str) -> None:
    for engine in (load(None, "off"), load(None, "auto", weights="float32")):
        assert engine.worker.runner.compiled is None
        assert engine.manifest["compile_cache"] is None
        assert engine.manifest["kv_cache_dtype"] == "float32"  # what the eager step reads


def test_the_compiled_step_keeps_a_float16_pool(compiled: Engine) -> None:
    """Half the bytes per token (auto, kv_cache.kv_cache_dtype); this module's parity,
    perplexity and row-exactness tests all run on it."""
    manifest, arch = compiled.manifest, compiled.worker.architecture
    assert manifest["kv_cache_dtype"] == "float16"
    assert manifest["kv_bytes_per_token"] == arch.kv_bytes_per_token(2)
    pool = compiled.worker.runner.kv_cache
    assert {t.dtype for t in (*pool.keys, *pool.values)} == {torch.float16}
    # The same 128 MiB budget holds twice the blocks a float32 pool would.
    assert manifest["kv_blocks"] == (128 << 20) // (arch.kv_bytes_per_token(2) * 16)


def test_without_a_cpp_compiler_auto_runs_eager(
    default_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slim image has no g++: inductor could not build the graph, so warm-up must not try."""
    monkeypatch.setattr(step_formats, "has_cpp_compiler", lambda: False)
    engine = load(None, "auto")
    assert engine.worker.runner.compiled is None and not engine.manifest["compiled"]
    assert engine.manifest["kv_cache_dtype"] == "float32"  # auto: what the eager step reads
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_greedy_output_matches_float32_on_the_default_model(compiled: Engine) -> None:
    assert compiled.tokenizer is not None
    prompts = [compiled.tokenizer.encode(q) for q in QUESTIONS]
    reference = greedy_runs(load(None, "off", weights="float32"), prompts, 16)
    verdicts = [
        compare(c, f) for c, f in zip(greedy_runs(compiled, prompts, 16), reference, strict=True)
    ]
    assert sum(v in ("match", "near_tie") for v in verdicts) >= 14, verdicts


def test_a_row_is_the_same_alone_and_in_a_batch(compiled: Engine) -> None:
    """Batched: decode rows beside prefill chunks and beside rows with longer block tables."""
    prompts = [[(331 * i + n) % 20000 + 100 for i in range(n)] for n in (3, 17, 40, 130, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    together = compiled.generate(prompts, params)
    for prompt, batched in zip(prompts, together, strict=True):
        alone = compiled.generate([prompt], params)[0]
        assert alone.token_ids == batched.token_ids
        assert [lp.top for lp in alone.logprobs] == [lp.top for lp in batched.logprobs]


def test_a_prefill_over_cached_blocks_gives_a_cold_prefills_bits(compiled: Engine) -> None:
    assert_cached_prefills_give_cold_bits(compiled)


def test_drafts_change_no_greedy_output(compiled: Engine) -> None:
    assert compiled.tokenizer is not None
    copy = compiled.tokenizer.encode(COPY_PROMPT)
    prompts = [copy, copy[:20] + copy, "The capital of France is", copy[5:]]
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
    plain = run(speculating(compiled, "off"), prompts, params)
    drafted = run(speculating(compiled, "ngram"), prompts, params)
    assert compiled.scheduler.speculator.num_accepted_drafts > 20  # it did speculate
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain]
    assert [[lp.top for lp in c.logprobs] for c in drafted] == [
        [lp.top for lp in c.logprobs] for c in plain
    ]
    speculating(compiled, "off")


def test_perplexity_within_one_percent_of_float32(compiled: Engine) -> None:
    """Through the graph's prompt-logprob rows (every position of a ~2k-token prefill)."""
    reference = load(None, "off", weights="float32")
    values = {}
    for name, engine in (("compiled", compiled), ("float32", reference)):
        ids = text_token_ids(engine.worker.model_path, SHIPPED_TEXT.read_text(encoding="utf-8"))
        values[name] = perplexity(engine.worker.prompt_log_softmax(ids), ids)
    assert 10 < values["float32"] < 40
    assert values["compiled"] / values["float32"] < 1.01


def test_prefill_rows_run_as_a_dense_gemm_only_where_that_is_faster(
    compiled: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 40-token prompt in 16-token chunks. Where prefill rows run dense (AMX, or torch's 4-bit
    kernel on a CPU with bfloat16 GEMMs), each of the three prefill steps multiplies every
    projection's prefill rows by its dense weight (one 256-row piece); `kvmesh::int4_dot`
    elsewhere runs them itself. The decode steps after them never dequantize."""
    pieces: list[tuple[int, ...]] = []
    multiply = torch.mm

    def counting(rows: torch.Tensor, weight: torch.Tensor, **out: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            pieces.append((rows.shape[0], *weight.shape))
        return multiply(rows, weight, **out)

    monkeypatch.setattr(torch, "mm", counting)
    prompt = [(37 * i) % 20000 + 100 for i in range(40)]
    compiled.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    qkv = compiled.worker.runner.model.weights.layers[0].qkv
    if isinstance(qkv, Int4DotLinear):
        dense = prefill_rows_dense()
    else:
        dense = isinstance(qkv, Int4Linear) and qkv.dense_parts is not None
    layers = compiled.worker.architecture.num_layers
    assert len(pieces) == (3 * 4 * layers if dense else 0)  # qkv, o, gate_up, down
    assert {rows for rows, *_ in pieces} <= {graph_ops.PREFILL_PIECE}


def test_the_graphs_warm_up_compiled_serve_every_kind_of_step(compiled: Engine) -> None:
    """After prefill-only, decode-only and mixed steps of 1 to 4 rows and any block count (the
    tests above ran on this engine): no graph more than its warm-up compiled (the step's two),
    and another engine of the model, with another KV budget, reuses them."""
    assert graphs_compiled() == GRAPHS_AT_START[0]
    other = Engine(EngineConfig(compile="auto", cache=CacheConfig(kv_memory_bytes=40 << 20)))
    other.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert graphs_compiled() == GRAPHS_AT_START[0]


@pytest.mark.parametrize(
    "checkpoint, quantize",
    [("tiny_qwen2_dir", "int4"), ("tiny_qwen2_dir", "int8"), ("tiny_qwen3_dir", "int8")],
)
def test_a_qwen_checkpoint_quantized_at_load_compiles_with_its_biases_and_norms(
    checkpoint: str, quantize: str, request: pytest.FixtureRequest
) -> None:
    """Qwen2's q/k/v biases; Qwen3's per-head Q/K norms."""
    path = request.getfixturevalue(checkpoint)
    prompts = [[5 + i, 9, 200 - i, 17, *range(3 + i, 30 + 3 * i)] for i in range(16)]
    engine = load(path, "auto", quantize=quantize)
    assert engine.worker.runner.compiled is not None
    fast_int4 = quantize == "int4" and (int4_kernel_is_fast() or int4_dot_is_available())
    projection = engine.worker.runner.model.weights.layers[0].qkv
    int4, int8 = (Int4Linear, Int4DotLinear), (Int8Linear, Int8DotLinear)
    assert isinstance(projection, int4 if fast_int4 else int8)
    eager = load(path, "off", quantize=quantize)
    # The same weights eager: the graph's fused float ops round differently, not more.
    runs = [greedy_runs(e, prompts, 12) for e in (engine, eager)]
    verdicts = [compare(c, e) for c, e in zip(*runs, strict=True)]
    assert sum(v in ("match", "near_tie") for v in verdicts) >= 14, verdicts


def test_an_int8_handle_names_its_projection_while_it_lives() -> None:
    """The graph names fbgemm's packed weights by handle; a dropped model's handles go too."""
    projection = Int8Linear(torch.randn(8, 16))
    handle = int8_handle(projection)
    rows = torch.randn(2, 18)
    expected = torch.ops.quantized.linear_dynamic(rows, projection._packed, True)
    assert torch.equal(torch.ops.kvmesh.int8_rows(rows, handle, 8), expected)
    assert int8_projection(handle) is projection
    del projection
    with pytest.raises(KeyError):
        int8_projection(handle)
