"""The real cupy backend on the CPU stand-in for CuPy: greedy tokens equal the torch backend's
(plain, batched and chunked, prefix cached, n > 1 forks, speculative drafts, preemption, fp32
and bf16), decode graphs hold only our kernels and GEMMs within a launch budget, a failed
capture runs eagerly with its reason in the manifest, and the fit check counts what the
runner allocates."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from pathlib import Path

import pytest

from kvmesh.engine import Engine
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.sampling import SamplingParams
from tests.cupy_standin import installed
from tests.engine_worker.parity import Greedy, compare
from tests.engine_worker.test_speculative import speculating

BATCHING = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4, prefill_chunk_size=16)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# A decode step's launches per layer: 2 norms (the first layer's with the embedding), 4 GEMMs,
# attention (with the rotary, the KV write and its own merge), the SwiGLU product; plus the
# final norm, the LM head and the sampling kernel.
LAUNCHES_PER_LAYER, LAUNCHES_OUTSIDE_LAYERS = 8, 3


def engine(model: str, backend: str, **overrides: object) -> Engine:
    config = dict(
        model=model,
        backend=backend,
        cache=CacheConfig(kv_memory_bytes=4 << 20),
        scheduler=BATCHING,
    )
    return Engine(EngineConfig(**{**config, **overrides}))  # type: ignore[arg-type]


def prompts(count: int = 6, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (4 to 70 tokens) that share a motif: chunked, batched, prefix hits."""
    rng = random.Random(seed)
    motif = [rng.randrange(3, 500) for _ in range(20)]
    return [
        motif[: 4 + 3 * i] + [rng.randrange(3, 500) for _ in range(11 * i)] for i in range(count)
    ]


def tokens(completions: list) -> list[list[int]]:
    assert all(c.error is None for c in completions)
    return [c.token_ids for c in completions]


# Gemma 3: sandwich norms, GeGLU, the embedding scale, and sliding layers (a 24-token window,
# prompts to 74 tokens) with their own RoPE.
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "gemma3"])
@pytest.mark.parametrize("chunk, prefix", [(None, False), (16, True)])
def test_greedy_tokens_equal_the_torch_backend(checkpoints, standin, kind, chunk, prefix) -> None:
    scheduler = dataclasses.replace(BATCHING, prefill_chunk_size=chunk)
    cache = CacheConfig(kv_memory_bytes=4 << 20, enable_prefix_caching=prefix)
    expected = tokens(engine(checkpoints[kind], "torch").generate(prompts(), GREEDY))
    ours = engine(checkpoints[kind], "cupy", scheduler=scheduler, cache=cache)
    assert set(ours.worker.manifest.cuda_graphs.values()) == {"graph"}
    assert tokens(ours.generate(prompts(), GREEDY)) == expected
    assert standin.launches.count("graph") > 0  # decode steps replayed their graphs
    assert not standin.cupy_cublas_calls and not standin.violations
    load = ours.scheduler.load()
    assert load.num_free_blocks == load.num_blocks
    assert (load.prefix_hit_tokens > 0) == prefix


def test_gemma3_logprobs_equal_the_torch_backend(checkpoints, standin) -> None:
    """Greedy tokens of random weights hide a layer that reads past its window (they matched
    with the window off): the logprobs do not (it moved them by up to 1.0)."""
    params = dataclasses.replace(GREEDY, logprobs=1)
    expected = engine(checkpoints["gemma3"], "torch").generate(prompts(), params)
    ours = engine(checkpoints["gemma3"], "cupy").generate(prompts(), params)
    assert tokens(ours) == tokens(expected)
    for mine, theirs in zip(ours, expected, strict=True):
        for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_graphs_off_runs_every_step_eagerly_with_the_same_tokens(
    checkpoints, standin, monkeypatch
) -> None:
    monkeypatch.setenv("KVMESH_CUDA_GRAPHS", "0")
    ours = engine(checkpoints["llama"], "cupy")
    assert set(ours.worker.manifest.cuda_graphs.values()) == {"off (KVMESH_CUDA_GRAPHS=0)"}
    expected = tokens(engine(checkpoints["llama"], "torch").generate(prompts(), GREEDY))
    assert tokens(ours.generate(prompts(), GREEDY)) == expected
    assert "graph" not in standin.launches


def test_bfloat16_stays_with_the_torch_backend_until_a_near_tie(checkpoints, standin) -> None:
    params = dataclasses.replace(GREEDY, logprobs=3)

    def greedy(backend: str) -> list[Greedy]:
        done = engine(checkpoints["llama"], backend, dtype="bfloat16").generate(prompts(), params)
        return [Greedy(c.token_ids, [[t for t, _ in lp.top] for lp in c.logprobs]) for c in done]

    verdicts = [compare(o, r) for o, r in zip(greedy("cupy"), greedy("torch"), strict=True)]
    assert all(v in ("match", "near_tie") for v in verdicts), verdicts
    # Random weights: bf16 rounding in another order (numpy float32 GEMMs, torch's bf16 ones)
    # meets near-ties within 12 tokens in most prompts: 2+ of 6 matched whole on an AVX-512 CPU,
    # 1 on an AVX2 one, where torch emulates bf16.
    assert verdicts.count("match") >= 1, verdicts


def forked(model: Engine, params: SamplingParams, n: int = 4) -> list[list[int]]:
    """n completions of one prompt in one group: they share its blocks and fork the last."""
    prompt = prompts(4)[3][:37]  # two full blocks of 16 and a partial one each fork copies
    ids = [
        model.add_request(prompt, dataclasses.replace(params, seed=7 + i), group_id="g")
        for i in range(n)
    ]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while model.has_unfinished():
        for output in model.step():
            out[output.request_id].extend(output.new_token_ids)
    return [out[i] for i in ids]


def test_n_forks_copy_their_blocks_and_sample_as_the_torch_backend(checkpoints, standin) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    ours = engine(checkpoints["llama"], "cupy")
    sampled = forked(ours, params)
    assert sampled == forked(engine(checkpoints["llama"], "torch"), params)
    assert len({tuple(s) for s in sampled}) > 1  # four seeds, four continuations
    assert "cupy:assign" in standin.launches  # the partial block was copied on the device
    # Drawn on the device: every gather is a block copy's, none picks logits for the host.
    assert standin.launches.count("cupy:gather") == standin.launches.count("cupy:assign")
    load = ours.scheduler.load()
    assert load.num_free_blocks == load.num_blocks


def test_speculative_drafts_leave_greedy_tokens_unchanged(checkpoints, standin) -> None:
    rng = random.Random(3)
    motif = [rng.randrange(3, 500) for _ in range(12)]
    repetitive = [motif * 3, motif * 2 + motif[:5], [rng.randrange(3, 500) for _ in range(40)]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = tokens(engine(checkpoints["llama"], "torch").generate(repetitive, params))
    ours = speculating(
        engine(checkpoints["llama"], "cupy"), "ngram", ngram_min=1, draft_row_cost=0.0
    )
    assert tokens(ours.generate(repetitive, params)) == expected
    assert ours.scheduler.speculator.num_draft_tokens > 10  # draft rows went through the GPU path


def test_preemption_under_a_tight_kv_budget_gives_the_same_tokens(checkpoints, standin) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = tokens(engine(checkpoints["llama"], "torch").generate(prompts(), params))
    roomy = engine(checkpoints["llama"], "cupy")
    block_bytes = roomy.worker.manifest.kv_bytes_per_token * 16
    tight = engine(
        checkpoints["llama"], "cupy", cache=CacheConfig(kv_memory_bytes=12 * block_bytes)
    )
    assert tokens(tight.generate(prompts(), params)) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.load().num_free_blocks == tight.scheduler.load().num_blocks


def test_a_decode_graph_holds_only_kernels_and_gemms_within_the_launch_budget(
    checkpoints, standin
) -> None:
    ours = engine(checkpoints["llama"], "cupy")
    graphs = ours.worker.runner.graphs
    layers = ours.worker.architecture.num_layers
    for size, (graph, _) in graphs.graphs.items():
        names = graph.node_names
        assert not [n for n in names if n.startswith("cupy:")], size  # no CuPy array kernels
        assert names.count("gemm") == 4 * layers + 1, size
        assert len(names) <= LAUNCHES_PER_LAYER * layers + LAUNCHES_OUTSIDE_LAYERS, (size, names)
        assert not [n for n in names if n.startswith("rotary_and_cache")], size  # fused
        assert names[-1] == "sample_tokens", size  # sampling inside the graph
    assert not standin.violations


STEADY = {
    "greedy": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0),
    "sampled": SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=40, min_p=0.01,
                              ignore_eos=True, logprobs=0),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(STEADY))
def test_a_steady_decode_step_is_one_copy_in_one_replay_one_copy_out(
    checkpoints, standin, kind
) -> None:
    ours = engine(checkpoints["llama"], "cupy")
    for index, prompt in enumerate(prompts(4)):
        seed = index if index % 2 else None  # seeded and unseeded rows side by side
        ours.add_request(prompt, dataclasses.replace(STEADY[kind], seed=seed))
    for _ in range(3):  # the prompts, admitted over three steps
        ours.step()
    measured = 0
    while ours.has_unfinished():
        before = dataclasses.replace(standin, launches=list(standin.launches))
        outputs = ours.step()
        if len(outputs) < 4:
            break  # the last steps, as requests finish, are no longer a steady batch
        assert standin.launches[len(before.launches) :] == ["graph"]  # nothing outside it
        assert standin.copies_to_device - before.copies_to_device == 1
        assert standin.copies_to_host - before.copies_to_host == 1
        assert standin.synchronizations - before.synchronizations == 1
        assert standin.allocations == before.allocations
        assert all(o.logprobs and o.logprobs[-1].logprob <= 0.0 for o in outputs)
        measured += 1
    assert measured >= 5


def test_a_larger_step_budget_reaches_the_worker_and_runs(checkpoints, standin) -> None:
    """A step of ~3,600 tokens, past the 2,048 default: the worker's buffers are sized from
    the flags its own parser takes (as `kvmesh up` forwards them), and it says so."""
    from services.engine_worker.config import build_parser, engine_config

    argv = ["--model", checkpoints["llama"], "--backend", "cupy", "--kv-memory", "16MiB"]
    config = engine_config(build_parser().parse_args([*argv, "--max-batched-tokens", "4096"]))
    assert config.scheduler.max_num_batched_tokens == 4096
    big = dataclasses.replace(config.scheduler, prefill_chunk_size=None, max_num_seqs=4)
    ours = Engine(dataclasses.replace(config, scheduler=big))
    assert ours.worker.manifest.max_step_tokens == 4096
    rng = random.Random(5)
    long_prompts = [[rng.randrange(3, 500) for _ in range(900)] for _ in range(4)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    expected = tokens(
        engine(
            checkpoints["llama"],
            "torch",
            scheduler=big,
            cache=CacheConfig(kv_memory_bytes=16 << 20),
        ).generate(long_prompts, params)
    )
    assert tokens(ours.generate(long_prompts, params)) == expected


def test_a_failed_capture_runs_eagerly_and_the_manifest_says_why(
    checkpoints, standin, monkeypatch, caplog
) -> None:
    """The old GEMM path (CuPy's cuBLAS wrapper, refused while capturing) in the largest
    bucket only: that bucket runs eagerly, the others replay, no step fails."""
    from services.engine_worker.cupy_backend import cublas_gemm

    original = cublas_gemm.CublasGemm.__call__

    def through_cupy_when_four_rows(self, x, weight, out, spec, out_type=None):  # type: ignore[no-untyped-def]
        if x.shape[0] == 4:
            cublas_gemm.cupy.cuda.cublas.setPointerMode(1, 0)
        original(self, x, weight, out, spec, out_type)

    monkeypatch.setattr(cublas_gemm.CublasGemm, "__call__", through_cupy_when_four_rows)
    with caplog.at_level(logging.WARNING, "kvmesh.engine_worker.graphs"):
        ours = engine(checkpoints["llama"], "cupy")
        generated = tokens(ours.generate(prompts(), GREEDY))
    report = ours.worker.manifest.cuda_graphs
    assert report["1"] == report["2"] == "graph"
    assert "cupy.cuda.cublas.setPointerMode" in report["4"], report
    assert len([r for r in caplog.records if "capture failed" in r.getMessage()]) == 1
    assert generated == tokens(engine(checkpoints["llama"], "torch").generate(prompts(), GREEDY))


def test_the_fit_check_counts_what_the_runner_allocates_before_allocating(
    checkpoints, monkeypatch
) -> None:
    from services.engine_worker import capacity

    checked: list[dict[str, int]] = []
    original = capacity.check_memory_fits

    def recording(parts: dict[str, int], backend: str) -> None:
        checked.append(dict(parts))
        original(parts, backend)

    monkeypatch.setattr(capacity, "check_memory_fits", recording)
    with installed() as state:
        ours = engine(checkpoints["llama"], "cupy")
        loaded = state.allocated_bytes
        assert loaded <= sum(checked[-1].values())  # all it holds was in the check
        workspace = ours.worker.runner.workspace.num_bytes
        ours.generate(prompts(), GREEDY)
        assert (
            state.peak_bytes - loaded < workspace // 4
        )  # steps allocate no workspace of their own
    with installed(free_bytes=loaded - workspace) as state:
        with pytest.raises(KvmeshError) as refused:
            engine(checkpoints["llama"], "cupy")
        assert refused.value.reason == Reason.MODEL_DOES_NOT_FIT
        assert "step workspace" in str(refused.value)
        assert state.allocated_bytes == 0  # refused before the first allocation
    with installed(free_bytes=loaded + workspace) as state:
        state.pooled_bytes = loaded  # a dropped model's blocks, kept by CuPy's pool
        engine(checkpoints["llama"], "cupy")  # they are free to the next model


def test_nothing_in_services_calls_cupys_cublas_wrapper() -> None:
    """CuPy's wrapper refuses every call while a stream captures (cupy/cupy#6290)."""
    services = Path(__file__).resolve().parents[2] / "services"
    wrapper = re.compile(r"cupy\.cuda\.cublas|from cupy\.cuda import cublas|get_cublas_handle")
    found = [str(p) for p in services.rglob("*.py") if wrapper.search(p.read_text())]
    assert not found
