"""Sampling from logits: penalties, logit bias, temperature, min-p, top-k, top-p, seeds, logprobs.

A token is drawn by inverse CDF, in token order, with one uniform from a counter-based generator
keyed by (key, index): a seeded request's key is its seed and the index its output position,
so its output does not depend on the batch around it, nor on preemption and recompute, nor on
the backend: the cupy backend's sampling kernel (sample_tokens.cu) draws the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from services.engine_worker.grammar import allowed_tokens
from services.engine_worker.step_failures import NonFiniteLogits, NoSamplingMass, failure_of
from services.engine_worker.step_inputs import RequestState
from shared.sampling import SamplingParams
from shared.step import FailedRequest, SampledToken, TokenLogprobs

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices apart
_MASK = (1 << 64) - 1
ACCEPT_STREAM = 0x5851F42D4C957F2D  # a key's second stream: draft acceptance tests


def counter_uniform(key: int, index: int) -> float:
    """SplitMix64 of (key, index): 24 random bits as a float in [0, 1), as the GPU computes it."""
    z = (key * _SEED_MIX + index + _SEED_MIX) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z >> 40) / float(1 << 24)


def sample_key(state: RequestState, rng: torch.Generator) -> tuple[int, int]:
    """(key, index) of a row's draw: a seeded request's seed and output position; a fresh
    random key from the step's generator otherwise."""
    if state.sampling.seed is not None:
        return state.sampling.seed & _MASK, len(state.token_ids) - state.prompt_len
    return int(torch.randint(0, 1 << 62, (), generator=rng)), 0


def inverse_cdf(weights: torch.Tensor, uniform: float) -> int:
    """The first token whose cumulative weight, in token order, passes uniform x total."""
    cumulative = torch.cumsum(weights.double(), dim=0)
    total = float(cumulative[-1])
    if not 0.0 < total < math.inf:
        raise NoSamplingMass(f"the probabilities sum to {total}")
    target = torch.tensor([uniform * total], dtype=torch.float64)
    index = int(torch.searchsorted(cumulative, target, right=True))
    if index >= weights.shape[0]:  # rounding at the very end: the last token that has weight
        index = int(weights.nonzero().max())
    return index


def sample(
    logits: torch.Tensor, states: Sequence[RequestState], rng: torch.Generator
) -> list[SampledToken | FailedRequest]:
    """logits: (S, vocab) float32, one row per state; one outcome per state, in order. Logprobs
    come from the model's own distribution; a response format only narrows what may be
    sampled. Each row's own work runs in its own error boundary: a row that raises (a grammar,
    a penalty, non-finite logits) becomes a FailedRequest and the other rows keep their token.
    Rows with draft tokens to verify go through verification.py instead."""
    raw = logits
    outcomes: list[SampledToken | FailedRequest | None] = [None] * len(states)
    for row in _non_finite_rows(raw):
        outcomes[row] = failure_of(states[row].request_id, NonFiniteLogits("non-finite logits"))
    matchers = {row: s.matcher for row, s in enumerate(states) if s.matcher is not None}
    if matchers:
        logits = logits.clone()

        def mask(row: int) -> None:
            allowed = allowed_tokens(matchers[row], logits.shape[-1])
            # A finished format (ignore_eos ran past its end) allows nothing: sample freely
            # rather than from an all -inf row.
            if allowed.any():
                logits[row].masked_fill_(~allowed, float("-inf"))

        _each_row(list(matchers), states, outcomes, mask)
    plain_greedy = [
        i
        for i, s in enumerate(states)
        if s.sampling.greedy
        and not s.sampling.has_penalties
        and not s.sampling.logit_bias
        and outcomes[i] is None
    ]
    chosen = [0] * len(states)
    if plain_greedy:
        rows = logits if len(plain_greedy) == len(states) else logits[plain_greedy]  # no copy
        argmax = rows.argmax(dim=-1).tolist()
        for row, token in zip(plain_greedy, argmax, strict=True):
            chosen[row] = token
    greedy_set = set(plain_greedy)

    def draw(row: int) -> None:
        chosen[row] = _sample_row(logits[row], states[row], rng)

    _each_row([r for r in range(len(states)) if r not in greedy_set], states, outcomes, draw)

    def finish(row: int) -> None:
        state = states[row]
        logprobs = None
        if state.sampling.logprobs is not None:
            logprobs = logprobs_of(raw[row], chosen[row], state.sampling.logprobs)
        if state.matcher is not None:
            state.matcher.consume_token(chosen[row])
        outcomes[row] = SampledToken(state.request_id, chosen[row], logprobs)

    _each_row(range(len(states)), states, outcomes, finish)
    return [outcome for outcome in outcomes if outcome is not None]


def _non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Rows with a NaN or an infinity. A row's sum is then non-finite too: one pass over the
    logits instead of isfinite's three (2 ms a step at 32 rows of a 49k vocabulary); a finite
    row whose sum overflows is checked again, element by element."""
    suspects = (~torch.isfinite(logits.sum(dim=-1))).nonzero().flatten().tolist()
    return [row for row in suspects if not torch.isfinite(logits[row]).all()]


def _each_row(
    rows: Iterable[int],
    states: Sequence[RequestState],
    outcomes: list[SampledToken | FailedRequest | None],
    work: Callable[[int], None],
) -> None:
    """`work(row)` for each row that has not failed yet; a row that raises fails alone."""
    for row in rows:
        if outcomes[row] is not None:
            continue
        try:
            work(row)
        except Exception as error:  # one request's failure, kept to that request
            outcomes[row] = failure_of(states[row].request_id, error)


def _sample_row(logits: torch.Tensor, state: RequestState, rng: torch.Generator) -> int:
    logits, probs = processed(logits, state)
    if probs is None:
        return int(logits.argmax())
    return inverse_cdf(probs, counter_uniform(*sample_key(state, rng)))


def processed(
    logits: torch.Tensor, state: RequestState
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The row's logits after penalties and bias, and the (unnormalized) probabilities it
    samples from after temperature, min-p, top-k and top-p; None for a greedy request."""
    params = state.sampling
    if params.has_penalties:
        logits = _apply_penalties(logits.clone(), state.token_ids, state.prompt_len, params)
    if params.logit_bias:
        tokens, biases = zip(*params.logit_bias, strict=True)
        logits = logits.index_add(0, torch.tensor(tokens), torch.tensor(biases, dtype=logits.dtype))
    if params.greedy:
        return logits, None
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_k is not None and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        # Keep a token while the mass of the tokens strictly more likely is within top_p:
        # tied tokens at the cut are kept or dropped together, as the GPU's threshold does.
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        first_of_tie = torch.searchsorted(-sorted_probs, -sorted_probs, side="left")
        sorted_probs = sorted_probs.masked_fill(
            mass_before[first_of_tie] > params.top_p * sorted_probs.sum(), 0.0
        )
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return logits, probs


def _apply_penalties(
    logits: torch.Tensor, token_ids: list[int], prompt_len: int, params: SamplingParams
) -> torch.Tensor:
    """Repetition penalty over prompt and output (as transformers and vLLM); presence and
    frequency over output only (as OpenAI)."""
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    output = token_ids[prompt_len:]
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            logits.dtype
        )
    return logits


def logprobs_of(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    log_probs = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        values, ids = torch.topk(log_probs, top_n)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id, float(log_probs[token_id]), top)
