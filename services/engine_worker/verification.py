"""Speculative decoding's verification: a request's draft tokens against the model's own choice
at each of their positions, computed in the same step (one decode row per token).

Greedy requests accept the longest run of drafts equal to the argmax, plus the token the model
chose at the first mismatch (or after the last draft): exactly the tokens decoding without
drafts gives. Sampled requests use the standard rejection rule with the drafts as a point-mass
proposal: draft d is accepted with probability p(d) under the request's processed distribution
(temperature, top-k/p, min-p, penalties, bias, response format), and on rejection the token is
drawn from p without d, renormalized, so every output token is distributed as p itself. A
seeded request draws position j's numbers from its generator for output index j, so its output
is reproducible (though not the same as without drafts: the draws differ).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from services.engine_worker.grammar import allowed_tokens
from services.engine_worker.sampler import (
    ACCEPT_STREAM,
    counter_uniform,
    inverse_cdf,
    logprobs_of,
    processed,
    sample,
    sample_key,
)
from services.engine_worker.step_failures import NonFiniteLogits, failure_of
from services.engine_worker.step_inputs import RequestState
from shared.step import FailedRequest, SampledToken, TokenLogprobs


def sample_and_verify(
    logits: torch.Tensor, states: Sequence[RequestState], rng: torch.Generator
) -> list[SampledToken | FailedRequest]:
    """logits: (S, vocab), one row per state (a speculating request's rows side by side, one
    per draft and one more); one outcome per request, in row order."""
    if not any(state.num_drafts for state in states):
        return sample(logits, states, rng)
    plain = [row for row, state in enumerate(states) if not state.num_drafts]
    outcomes: dict[int, SampledToken | FailedRequest] = dict(
        zip(plain, sample(logits[plain], [states[r] for r in plain], rng), strict=True)
    )
    row = 0
    while row < len(states):
        state = states[row]
        if state.num_drafts:
            rows = logits[row : row + state.num_drafts + 1]
            try:
                outcomes[row] = _verify(rows, state, rng)
            except Exception as error:  # this request's failure, kept to it
                outcomes[row] = failure_of(state.request_id, error)
            row += state.num_drafts + 1
        else:
            row += 1
    return [outcomes[r] for r in sorted(outcomes)]


def _verify(rows: torch.Tensor, state: RequestState, rng: torch.Generator) -> SampledToken:
    """rows: (k + 1, vocab) for a request whose last k tokens are drafts."""
    if not torch.isfinite(rows).all():
        raise NonFiniteLogits("non-finite logits")
    num_drafts = state.num_drafts
    drafts = state.token_ids[len(state.token_ids) - num_drafts :]
    known = len(state.token_ids) - num_drafts
    wants_logprobs = state.sampling.logprobs is not None
    accepted: list[TokenLogprobs] = []
    for index, raw in enumerate(rows):
        # The request as it stood before this position's token: penalties, seed index, format.
        before = dataclasses.replace(state, token_ids=state.token_ids[: known + index])
        logits = raw
        if state.matcher is not None:
            allowed = allowed_tokens(state.matcher, raw.shape[-1])
            if allowed.any():
                logits = raw.masked_fill(~allowed, float("-inf"))
        logits, probs = processed(logits, before)
        draft = drafts[index] if index < num_drafts else None
        if probs is None:
            choice = int(logits.argmax())
            if choice == draft:
                accepted.append(_accept(state, raw, choice, wants_logprobs))
                continue
        else:
            key, position = sample_key(before, rng)
            probs = probs / probs.sum()
            if draft is not None:
                if counter_uniform(key ^ ACCEPT_STREAM, position) < float(probs[draft]):
                    accepted.append(_accept(state, raw, draft, wants_logprobs))
                    continue
                probs = probs.clone()
                probs[draft] = 0.0  # rejected: the rest of p, renormalized by the draw
            # A position with no draft draws as a request without speculation would.
            choice = inverse_cdf(probs, counter_uniform(key, position))
        final = _accept(state, raw, choice, wants_logprobs)
        return SampledToken(
            state.request_id,
            choice,
            final if wants_logprobs else None,
            num_accepted_drafts=index,
            draft_logprobs=tuple(accepted) if wants_logprobs else (),
        )
    raise AssertionError("the last row always picks a token")


def _accept(state: RequestState, raw: torch.Tensor, token: int, wants: bool) -> TokenLogprobs:
    """The token joins the output: its format moves on; its logprobs from the raw row."""
    if state.matcher is not None:
        state.matcher.consume_token(token)
    top = state.sampling.logprobs or 0
    return logprobs_of(raw, token, top) if wants else TokenLogprobs(token, 0.0, ())
