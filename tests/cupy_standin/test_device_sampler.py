"""The GPU sampler (sample_tokens.cu) on fixed logits: each filter's distribution by a
chi-square test, filtered tokens never drawn, a seeded row's token independent of the batch
around it and equal to the torch sampler's, and the counter generator the same as the host's.
Here on the CPU stand-in (its numpy version of the kernel); tests/gpu/test_sampling.py runs the
same tests on a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy
import pytest
import torch

from services.engine_worker.sampler import counter_uniform, inverse_cdf
from tests.cupy_standin import installed

VOCAB = 24
DRAWS = 3000


@pytest.fixture
def cupy() -> Iterator[Any]:
    with installed():
        import cupy

        yield cupy


def fixed_logits() -> numpy.ndarray:
    """A spread of probabilities with one tie, so each filter cuts somewhere."""
    logits = numpy.linspace(2.0, -3.0, VOCAB).astype(numpy.float32)
    logits[5] = logits[4]
    return numpy.random.default_rng(3).permutation(logits)


def expected_distribution(
    logits: numpy.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> numpy.ndarray:
    """The torch sampler's semantics in float64: softmax, then min-p, top-k (ties kept), top-p
    (ties at the cut kept together)."""
    probs = numpy.exp((logits - logits.max()) / temperature).astype(numpy.float64)
    probs /= probs.sum()
    probs[probs < min_p * probs.max()] = 0.0
    if top_k:
        probs[probs < numpy.sort(probs)[-top_k]] = 0.0
    if top_p < 1.0:  # a token stays while the mass strictly above it is within top_p
        above = numpy.asarray([probs[probs > p].sum() for p in probs])
        probs[above > top_p * probs.sum()] = 0.0
    return probs / probs.sum()


def draw(cupy: Any, rows: numpy.ndarray, **fields: numpy.ndarray) -> tuple[numpy.ndarray, ...]:
    """tokens, logprobs, top ids, top logprobs of one launch over `rows`."""
    from services.engine_worker.cupy_backend.kernels.sample_tokens import (
        MAX_TOP,
        ROW_FIELDS,
        SamplingRows,
        sample_tokens,
    )

    count = rows.shape[0]
    params = {
        name: cupy.asarray(numpy.broadcast_to(fields.get(name, value), count).astype(dtype))
        for name, dtype, value in ROW_FIELDS
    }
    adjustments = fields.get("adjustments", numpy.zeros((1, 4), numpy.float32))
    tokens, logprobs = cupy.empty(count, numpy.int32), cupy.empty(count, numpy.float32)
    top_ids = cupy.zeros((count, MAX_TOP), numpy.int32)
    top_logprobs = cupy.zeros((count, MAX_TOP), numpy.float32)
    rows_d = SamplingRows(**params, adjustments=cupy.asarray(adjustments))
    sample_tokens(cupy.asarray(rows), rows_d, tokens, logprobs, top_ids, top_logprobs)
    return tokens.get(), logprobs.get(), top_ids.get(), top_logprobs.get()


FILTERS = {
    "temperature": dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    "top_k": dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    "top_p": dict(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0),
    "min_p": dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.2),
    "all": dict(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_each_filter_draws_its_distribution(cupy: Any, name: str) -> None:
    f = FILTERS[name]
    logits = fixed_logits()
    expected = expected_distribution(logits, f["temperature"], f["top_k"], f["top_p"], f["min_p"])
    tokens, logprobs, _, _ = draw(
        cupy,
        numpy.tile(logits, (DRAWS, 1)),
        temperatures=numpy.float32(f["temperature"]),
        top_ks=numpy.int32(f["top_k"]),
        top_ps=numpy.float32(f["top_p"]),
        min_ps=numpy.float32(f["min_p"]),
        keys=numpy.uint64(1234),
        indices=numpy.arange(DRAWS, dtype=numpy.uint64),
    )
    counts = numpy.bincount(tokens, minlength=VOCAB)
    assert not counts[expected == 0].any()  # a filtered token is never drawn
    kept = expected > 0
    statistic = float(
        ((counts[kept] - DRAWS * expected[kept]) ** 2 / (DRAWS * expected[kept])).sum()
    )
    dof = int(kept.sum()) - 1
    assert statistic < dof + 6 * (2 * dof) ** 0.5, (name, statistic, dof)  # p < 1e-5 to fail
    log_softmax = logits - logits.max() - numpy.log(numpy.exp(logits - logits.max()).sum())
    numpy.testing.assert_allclose(logprobs, log_softmax[tokens], rtol=1e-5, atol=1e-5)


def test_greedy_rows_take_the_lowest_id_among_ties(cupy: Any) -> None:
    logits = numpy.zeros((2, VOCAB), numpy.float32)
    logits[0, [3, 9]] = 5.0
    logits[1, 17] = 1.0
    tokens, logprobs, _, _ = draw(cupy, logits)
    assert tokens.tolist() == [3, 17]
    assert logprobs[0] == pytest.approx(5.0 - numpy.log(2 * numpy.exp(5.0) + VOCAB - 2), 1e-5)


def test_a_seeded_row_draws_the_same_token_in_any_batch(cupy: Any) -> None:
    """(key, index) alone decide the draw: not the row it sits in or its neighbours."""
    rng = numpy.random.default_rng(7)
    logits = fixed_logits()
    alone, *_ = draw(cupy, logits[None], temperatures=numpy.float32(1.0), keys=numpy.uint64(42),
                    indices=numpy.uint64(5))  # fmt: skip
    for position in (0, 3, 6):
        batch = rng.standard_normal((7, VOCAB)).astype(numpy.float32)
        batch[position] = logits
        keys = rng.integers(0, 1 << 62, 7).astype(numpy.uint64)
        keys[position] = 42
        indices = rng.integers(0, 100, 7).astype(numpy.uint64)
        indices[position] = 5
        tokens, *_ = draw(cupy, batch, temperatures=numpy.float32(1.0), keys=keys, indices=indices)
        assert tokens[position] == alone[0]
    host = inverse_cdf(torch.softmax(torch.from_numpy(logits), -1), counter_uniform(42, 5))
    assert host == alone[0]  # the torch sampler draws the same token for the same seed


def test_the_counter_generator_matches_the_hosts_and_is_uniform(cupy: Any) -> None:
    """A very hot temperature over equal logits turns each draw into floor(u * vocab)."""
    count, vocab = 2000, 1024
    tokens, *_ = draw(
        cupy,
        numpy.zeros((count, vocab), numpy.float32),
        temperatures=numpy.float32(1.0),
        keys=numpy.uint64(99),
        indices=numpy.arange(count, dtype=numpy.uint64),
    )
    uniforms = numpy.asarray([counter_uniform(99, i) for i in range(count)])
    assert (tokens == (uniforms * vocab).astype(int)).mean() > 0.999  # float rounding aside
    assert abs(uniforms.mean() - 0.5) < 0.02 and 0.28 < uniforms.std() < 0.30


def test_top_logprobs_come_in_order_with_ties_by_lower_id(cupy: Any) -> None:
    logits = fixed_logits()
    rows = numpy.stack([logits, logits, numpy.full(VOCAB, numpy.nan, numpy.float32)])
    top_ns = numpy.asarray([20, 3, 0], numpy.int32)
    tokens, logprobs, top_ids, top_logprobs = draw(
        cupy, rows, top_ns=top_ns, temperatures=numpy.asarray([0.0, 1.0, 0.0], numpy.float32)
    )
    log_softmax = logits - logits.max() - numpy.log(numpy.exp(logits - logits.max()).sum())
    expected = numpy.lexsort((numpy.arange(VOCAB), -logits))[:20]
    assert top_ids[0].tolist() == expected.tolist()
    numpy.testing.assert_allclose(top_logprobs[0], log_softmax[expected], rtol=1e-5, atol=1e-5)
    assert top_ids[1, :3].tolist() == expected[:3].tolist()  # a sampled row's alternatives too
    assert tokens[0] == expected[0] and not numpy.isfinite(logprobs[2])  # NaN row: flagged


def test_penalties_and_bias_draw_what_the_torch_sampler_draws(cupy: Any) -> None:
    """The host's adjustments applied by the kernel: the torch sampler's distribution (its
    own processed() as the oracle), and the logprob of the raw, unpenalized model."""
    from services.engine_worker.cupy_backend.device_sampling import adjustments_of
    from services.engine_worker.sampler import processed
    from services.engine_worker.step_inputs import RequestState
    from shared.sampling import SamplingParams

    logits = fixed_logits()
    params = SamplingParams(
        temperature=0.8, repetition_penalty=1.8, presence_penalty=0.4, frequency_penalty=0.3,
        logit_bias=((2, 1.5), (7, -100.0)),
    )  # fmt: skip
    state = RequestState("r", [3, 9, 9, 11, 3, 11, 11], [], 4, params, 1)  # 3 prompt tokens
    _, probs = processed(torch.from_numpy(logits.copy()), state)
    assert probs is not None
    expected = (probs / probs.sum()).double().numpy()
    entries = adjustments_of(state)
    # Every row its own copy of the entries: row r's are [r * E, (r + 1) * E).
    many = numpy.tile(entries, (DRAWS, 1))
    ends = (numpy.arange(1, DRAWS + 1) * entries.shape[0]).astype(numpy.int32)
    tokens, logprobs, _, _ = draw(
        cupy, numpy.tile(logits, (DRAWS, 1)), temperatures=numpy.float32(0.8),
        keys=numpy.uint64(5), indices=numpy.arange(DRAWS, dtype=numpy.uint64),
        adjust_ends=ends, adjustments=many,
    )  # fmt: skip
    counts = numpy.bincount(tokens, minlength=VOCAB)
    assert counts[7] == 0  # banned by its bias
    kept = expected > 1e-4
    want = DRAWS * expected[kept]
    statistic = float(((counts[kept] - want) ** 2 / want).sum())
    dof = int(kept.sum()) - 1
    assert statistic < dof + 6 * (2 * dof) ** 0.5, (statistic, dof)
    log_softmax = logits - logits.max() - numpy.log(numpy.exp(logits - logits.max()).sum())
    numpy.testing.assert_allclose(logprobs, log_softmax[tokens], rtol=1e-4, atol=1e-4)
    greedy, *_ = draw(cupy, logits[None], adjust_ends=numpy.int32(entries.shape[0]),
                      adjustments=entries)  # fmt: skip
    assert greedy[0] == int(processed(torch.from_numpy(logits.copy()), state)[0].argmax())
