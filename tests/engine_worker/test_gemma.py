"""Gemma 2 and 3 (text) on the torch backend: GGUFs as llama.cpp's converter writes them against
transformers, logprobs through the soft-capped head, sliding layers that read their window
only and keep it alone, packed weights, and the backend that refuses Gemma 2 (Gemma 3 on the
cupy backend: tests/cupy_standin/).

Greedy parity from the safetensors directories, with batching, chunked prefill and prefix
caching, is in test_parity_transformers.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.engine_worker.step_inputs import RequestState
from services.engine_worker.torch_backend.batch import build_batch
from shared.errors import ModelValidationError
from shared.sampling import SamplingParams
from tests.engine_worker.parity import (
    assert_mostly_matches,
    hf_model,
    kvmesh_greedy,
    transformers_greedy,
)
from tests.engine_worker.test_gguf_architectures import GEMMA2_PARTS, GEMMA3_PARTS, write_gguf_of
from tests.engine_worker.test_parity_transformers import mixed_prompts
from tests.model_fixtures import save_random_checkpoint

SAMPLING = SamplingParams(max_tokens=8)
# Longer than the fixtures' 24-token window, prefill and decode alike.
PROMPTS = [[5, 9, 200, 17], list(range(3, 60)), [44] * 30, list(range(100, 300, 7))]


@pytest.mark.parametrize(
    "kind, parts, overrides",
    [
        # What a GGUF can say: llama.cpp's own layer pattern (every 6th layer global) and
        # query scale (head_dim).
        ("gemma3", GEMMA3_PARTS, dict(num_hidden_layers=6, sliding_window_pattern=6,
                                      query_pre_attn_scalar=32)),
        ("gemma2", GEMMA2_PARTS, dict(query_pre_attn_scalar=16)),
    ],
)  # fmt: skip
def test_a_gemma_gguf_matches_transformers(
    kind: str, parts: tuple[str, ...], overrides: dict[str, float], tmp_path: Path
) -> None:
    hf_dir = save_random_checkpoint(tmp_path / "hf", kind, **overrides)
    target = tmp_path / f"{kind}.gguf"
    write_gguf_of(Path(hf_dir), target, kind, parts)
    model = hf_model(hf_dir)
    expected = transformers_greedy(model, PROMPTS, 16, eos=2)
    ours, engine = kvmesh_greedy(str(target), PROMPTS, 16)
    assert engine.manifest["architecture"] == model.config.architectures[0]
    # The window is the sliding layers' alone: the context served is the whole one.
    assert engine.worker.max_model_len == 1024
    assert_mostly_matches(ours, expected)


def test_logprobs_come_through_the_soft_capped_head(tiny_gemma2_dir: str) -> None:
    """Capping the logits keeps their order (greedy tokens cannot tell) but not their values."""
    from kvmesh.engine import Engine
    from shared.config import CacheConfig, EngineConfig

    prompt = list(range(3, 60))
    with torch.inference_mode():
        out = hf_model(tiny_gemma2_dir).generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    engine = Engine(
        EngineConfig(
            model=tiny_gemma2_dir,
            weights="float32",
            cache=CacheConfig(kv_memory_bytes=8 << 20),
        )
    )
    [completion] = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    )
    assert completion.token_ids == out.sequences[0, len(prompt) :].tolist()
    for token, logprob, reference in zip(
        completion.token_ids, completion.logprobs, expected, strict=True
    ):
        assert logprob.logprob == pytest.approx(reference[token].item(), abs=1e-3)


def test_a_sliding_layer_reads_only_its_window() -> None:
    """Decode pairs cover the window's blocks (the first one from the window's start); prefill
    masks hide every key more than a window behind its query."""
    block, window, context = 16, 24, 100
    decoding = RequestState("d", list(range(context)), list(range(7)), context - 1, SAMPLING, 90)
    prefilling = RequestState("p", list(range(40)), list(range(7, 10)), 0, SAMPLING, 40)
    batch = build_batch([(decoding, 1), (prefilling, 40)], block, 1, 1, 8, window=window)
    full, windowed = batch.meta.decode, batch.meta.windowed
    assert full is not None and windowed is not None and windowed.decode is not None
    assert full.pair_request.numel() == 7  # every block of the 100 positions
    # Positions 76-99: blocks 4 (from slot 12), 5 and 6 (to slot 3).
    assert windowed.decode.pair_request.numel() == 3
    visible = windowed.decode.pair_bias.view(3, block) == 0
    assert visible.sum().item() == window
    assert visible[0].tolist() == [False] * 12 + [True] * 4
    mask = windowed.prefills[0].mask
    assert mask is not None
    assert mask.sum(1).tolist() == [min(q + 1, window) for q in range(40)]
    assert batch.meta.prefills[0].mask is not None
    assert batch.meta.prefills[0].mask.sum(1).tolist() == [q + 1 for q in range(40)]


def test_packed_weights_run_gemma_eager(tiny_gemma3_dir: str) -> None:
    """The compiled CPU step is written for Llama's layer: a packed Gemma runs the eager model
    on its packed projections, with a pool of the activations' dtype."""
    from kvmesh.engine import Engine
    from shared.config import CacheConfig, EngineConfig

    prompts = mixed_prompts(3, 512)[:8]
    expected = transformers_greedy(hf_model(tiny_gemma3_dir), prompts, 12, eos=2)
    engine = Engine(
        EngineConfig(
            model=tiny_gemma3_dir,
            weights="packed",
            quantize="int8",
            cache=CacheConfig(kv_memory_bytes=8 << 20),
        )
    )
    assert engine.worker.runner.compiled is None
    assert engine.worker.runner.model.weights.format == "packed"
    completions = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    matches = sum(c.token_ids == e.tokens for c, e in zip(completions, expected, strict=True))
    assert matches >= 6, matches  # int8 rows round; the tokens follow the float model's


def test_the_cupy_backend_refuses_gemma2_by_name(
    tiny_gemma2_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its soft-capped scores are the torch backend's alone (Gemma 3 runs on both)."""
    from services.engine_worker import backends
    from services.engine_worker.worker import Worker
    from shared.config import EngineConfig

    monkeypatch.setattr(backends, "cuda_devices", lambda: 1)  # as if a GPU were there
    with pytest.raises(ModelValidationError) as refused:
        Worker(EngineConfig(model=tiny_gemma2_dir, backend="cupy"))
    assert "Gemma2ForCausalLM runs on the torch backend only" in str(refused.value)


def test_a_prepared_gemma_loads_with_its_norms(
    tiny_gemma3_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed weights stored and mapped back: the sandwich norms travel with them."""
    from kvmesh.engine import Engine
    from shared.config import CacheConfig, EngineConfig

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    config = EngineConfig(
        model=tiny_gemma3_dir,
        quantize="int8",
        prepared="auto",
        cache=CacheConfig(kv_memory_bytes=8 << 20),
    )
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    outputs = []
    for source in ("prepared", "loaded"):
        engine = Engine(config)
        assert engine.worker.manifest.preparation["source"] == source
        completions = engine.generate(PROMPTS, greedy)
        outputs.append([(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in completions])
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize(
    "kind, parts, overrides",
    [
        ("gemma3", GEMMA3_PARTS, dict(query_pre_attn_scalar=32)),
        ("gemma2", GEMMA2_PARTS, dict(query_pre_attn_scalar=16)),
    ],
)
def test_a_gemma_gguf_converts_to_a_directory_transformers_reads(
    kind: str, parts: tuple[str, ...], overrides: dict[str, float], tmp_path: Path
) -> None:
    """`kvmesh convert DIR` of a GGUF: norms back to transformers' w (the GGUF holds 1 + w),
    a config.json with the layer kinds, window, query scale, soft-caps and local RoPE; the
    directory answers as the GGUF does, in kvmesh and in transformers."""
    from kvmesh.convert import to_safetensors

    hf_dir = save_random_checkpoint(tmp_path / "hf", kind, **overrides)
    target = tmp_path / f"{kind}.gguf"
    write_gguf_of(Path(hf_dir), target, kind, parts)
    out = tmp_path / "out"
    to_safetensors(str(target), str(out))
    from_gguf, gguf_engine = kvmesh_greedy(str(target), PROMPTS, 12)
    from_dir, engine = kvmesh_greedy(str(out), PROMPTS, 12)
    assert [g.tokens for g in from_dir] == [g.tokens for g in from_gguf]
    # The same layer, read from the config.json: only where 1 is added to the norms differs.
    style = engine.worker.architecture.style
    assert dataclasses.replace(style, norm_offset=0.0) == gguf_engine.worker.architecture.style
    assert_mostly_matches(from_dir, transformers_greedy(hf_model(str(out)), PROMPTS, 12, eos=2))


def test_an_8k_context_keeps_the_window_of_its_sliding_layers(tmp_path: Path) -> None:
    """Gemma 3's sliding layers keep their window (and a block) of an 8k-token context, the
    full layer keeps it all, and the tokens are those of every layer keeping it all."""
    from kvmesh.engine import Engine
    from shared.config import CacheConfig, EngineConfig, SchedulerConfig

    window, block = 32, 16
    model = save_random_checkpoint(
        tmp_path / "hf", "gemma3", max_position_embeddings=8448, sliding_window=window
    )
    prompt = [3 + (i * 37) % 500 for i in range(8192)]
    outputs, held = {}, []
    for kept in ("full", "window"):
        engine = Engine(
            EngineConfig(
                model=model,
                weights="float32",
                cache=CacheConfig(kv_memory_bytes=64 << 20, sliding_window_kv=kept),
                scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=4),
            )
        )
        worker = engine.worker
        execute = worker.execute

        def held_after(plan, worker=worker, execute=execute, kept=kept):  # type: ignore[no-untyped-def]
            result = execute(plan)
            states = list(worker.requests.values())
            if kept == "window" and states and states[0].num_computed_tokens > len(prompt):
                [state] = states  # decoding
                held.append((len(state.block_ids), len([b for b in state.window_ids if b])))
            return result

        worker.execute = held_after  # type: ignore[method-assign]
        [completion] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
        outputs[kept] = completion.token_ids
        layers = worker.architecture.style.sliding_layers
        assert bool(worker.kv_shape.window_layers) == (kept == "window") and len(layers) == 2
    assert outputs["window"] == outputs["full"]
    assert held and all(full == 8192 // block + 1 for full, _ in held)
    assert max(window_blocks for _, window_blocks in held) * block <= window + block
