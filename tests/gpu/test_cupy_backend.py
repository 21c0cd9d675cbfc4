"""The cupy backend end to end on the default model: greedy output equals the torch backend's
(the CPU reference) token for token, up to float near-ties, with batching, chunked prefill and
prefix caching on and off; CUDA graphs and asking for top logprobs change no token."""

from __future__ import annotations

import pytest

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.engine_worker.parity import TOP, Greedy, compare
from tests.engine_worker.test_parity_transformers import CONFIGS, mixed_prompts


def run(
    backend: str,
    dtype: str,
    prompts: list[list[int]],
    chunk: int | None,
    prefix: bool,
    logprobs: int | None = TOP,
) -> tuple[list[Greedy], Engine]:
    engine = Engine(
        EngineConfig(
            backend=backend,
            dtype=dtype,
            # The reference runs the GGUF's weights dequantized, as the cupy backend does (the
            # torch backend's default packs them to int8 on the CPU: another rounding).
            weights="float32" if backend == "torch" else "auto",
            cache=CacheConfig(kv_memory_bytes=64 << 20, enable_prefix_caching=prefix),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=256, max_num_seqs=4, prefill_chunk_size=chunk
            ),
        )
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=logprobs)
    completions = engine.generate(prompts, params)
    return [
        Greedy(c.token_ids, [[t for t, _ in lp.top] for lp in c.logprobs]) for c in completions
    ], engine


@pytest.fixture(scope="module")
def torch_reference() -> tuple[list[list[int]], list[Greedy]]:
    prompts = mixed_prompts(100, 49000)
    return prompts, run("torch", "float32", prompts, None, False)[0]


@pytest.mark.parametrize("chunk, prefix", CONFIGS)
def test_fp32_greedy_matches_the_torch_backend(torch_reference, chunk, prefix) -> None:
    prompts, reference = torch_reference
    ours, engine = run("cupy", "float32", prompts, chunk, prefix)
    verdicts = [compare(o, r) for o, r in zip(ours, reference, strict=True)]
    assert all(v in ("match", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("match") >= 15, verdicts
    load = engine.scheduler.load()
    assert load.num_free_blocks == load.num_blocks
    assert (load.prefix_hit_tokens > 0) == prefix


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_stays_with_the_reference_until_a_near_tie(torch_reference, dtype) -> None:
    prompts, reference = torch_reference
    ours, _ = run("cupy", dtype, prompts, 16, True)
    verdicts = [compare(o, r) for o, r in zip(ours, reference, strict=True)]
    assert all(v in ("match", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("match") >= 10, verdicts


def test_cuda_graphs_and_top_logprobs_change_no_token(monkeypatch, torch_reference) -> None:
    prompts, _ = torch_reference
    graphed, engine = run("cupy", "float32", prompts, 16, True, logprobs=None)  # GPU argmax
    # Every bucket captured: GEMMs on our own cuBLAS handle are capturable.
    assert set(engine.worker.manifest.cuda_graphs.values()) == {"graph"}, (
        engine.worker.manifest.cuda_graphs
    )
    monkeypatch.setenv("KVMESH_CUDA_GRAPHS", "0")
    eager, _ = run("cupy", "float32", prompts, 16, True, logprobs=TOP)  # top logprobs too
    assert [g.tokens for g in graphed] == [e.tokens for e in eager]


def test_auto_picks_cupy_on_a_gpu() -> None:
    engine = Engine(EngineConfig(backend="auto", cache=CacheConfig(kv_memory_bytes=16 << 20)))
    assert engine.worker.backend == "cupy"
    assert engine.worker.manifest.backend == "cupy"


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "gemma3"])
def test_newer_architectures_match_the_torch_backend(kind: str, tmp_path_factory) -> None:
    """Qwen3's per-head Q/K norm kernel, Phi-3's fused projections and Gemma 3's layer (GeGLU,
    sandwich norms, sliding windows in both attention kernels) on the GPU, float32, graphs on:
    the torch backend's greedy tokens, up to near-ties."""
    from tests.model_fixtures import save_random_checkpoint

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = save_random_checkpoint(tmp_path_factory.mktemp(kind), kind, **shape)
    prompts = mixed_prompts(3, 500)

    def greedy(backend: str) -> list[Greedy]:
        engine = Engine(
            EngineConfig(
                model=path,
                backend=backend,
                dtype="float32",
                weights="float32" if backend == "torch" else "auto",
                cache=CacheConfig(kv_memory_bytes=16 << 20),
            )
        )
        done = engine.generate(
            prompts, SamplingParams(max_tokens=16, temperature=0.0, logprobs=TOP)
        )
        return [Greedy(c.token_ids, [[t for t, _ in lp.top] for lp in c.logprobs]) for c in done]

    verdicts = [compare(o, r) for o, r in zip(greedy("cupy"), greedy("torch"), strict=True)]
    assert all(v in ("match", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("match") >= len(verdicts) // 2, verdicts


def test_gemma3_sliding_layers_give_the_torch_backends_logprobs(tmp_path_factory) -> None:
    """Greedy tokens of random weights hide a layer reading past its window; logprobs show it
    (moved by up to 1.0 on the stand-in): both attention kernels' windows, float32."""
    from tests.model_fixtures import save_random_checkpoint

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = save_random_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", **shape)
    prompts = mixed_prompts(3, 500)  # many past the 24-token window
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)

    def run(backend: str) -> list:
        weights = "float32" if backend == "torch" else "auto"
        config = EngineConfig(
            model=path,
            backend=backend,
            dtype="float32",
            weights=weights,
            cache=CacheConfig(kv_memory_bytes=16 << 20),
        )
        return Engine(config).generate(prompts, params)

    compared = 0
    for ours, theirs in zip(run("cupy"), run("torch"), strict=True):
        if ours.token_ids != theirs.token_ids:
            continue  # a near-tie took another path; the tokens test judges those
        compared += 1
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
    assert compared >= len(prompts) // 2


def test_gemma3_head_dim_256_runs_in_bfloat16(tmp_path_factory) -> None:
    """Gemma 3 1B-12B's head_dim: both attention kernels' 256 instantiations (16-bit only;
    float32 is refused at load), against the torch backend up to near-ties."""
    from tests.model_fixtures import save_random_checkpoint

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = save_random_checkpoint(
        tmp_path_factory.mktemp("gemma3-256"),
        "gemma3",
        num_key_value_heads=1,
        head_dim=256,
        **shape,
    )
    prompts = mixed_prompts(3, 500)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=TOP)

    def greedy(backend: str) -> list[Greedy]:
        config = EngineConfig(
            model=path,
            backend=backend,
            dtype="bfloat16",
            cache=CacheConfig(kv_memory_bytes=16 << 20),
        )
        done = Engine(config).generate(prompts, params)
        return [Greedy(c.token_ids, [[t for t, _ in lp.top] for lp in c.logprobs]) for c in done]

    verdicts = [compare(o, r) for o, r in zip(greedy("cupy"), greedy("torch"), strict=True)]
    assert all(v in ("match", "near_tie") for v in verdicts), verdicts
    with pytest.raises(ValueError, match="256 in float16 or bfloat16"):
        Engine(EngineConfig(model=path, backend="cupy", dtype="float32"))
