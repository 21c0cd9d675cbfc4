"""Prompt logprobs: the logprob of each prompt token given the ones before it, from the logits
of the prefill rows that computed them (evaluation harnesses score text this way).

A chunk's rows come after the step's sampled rows (`FlatBatch.logit_rows`); each request's
scores go on its state for the step's result, one `PromptLogprobs` per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine_worker.step_inputs import FlatBatch, RequestState
from shared.step import FailedRequest, PromptLogprobs, TokenLogprobs


def score_prompts(logits: torch.Tensor, flat: FlatBatch) -> None:
    """logits: (len(flat.prompt_rows), vocab), in prompt_rows order. Row j of a chunk that
    starts at prompt position `start` scores prompt token start + j + 1."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    widest = max(state.sampling.prompt_logprobs or 0 for state, _, _ in flat.prompt_spans)
    top_values = top_ids = None
    if widest:
        top_values, top_ids = (t.tolist() for t in torch.topk(log_probs, widest))
    row = 0
    for state, start, count in flat.prompt_spans:
        targets = state.token_ids[start + 1 : start + 1 + count]
        rows = torch.arange(row, row + count)
        chosen = log_probs[rows, torch.tensor(targets)].tolist()
        top_n = state.sampling.prompt_logprobs or 0
        entries = []
        for index, (token, logprob) in enumerate(zip(targets, chosen, strict=True)):
            top: tuple[tuple[int, float], ...] = ()
            if top_n and top_ids is not None and top_values is not None:
                ids, values = top_ids[row + index][:top_n], top_values[row + index][:top_n]
                top = tuple(zip(ids, values, strict=True))
            entries.append(TokenLogprobs(token, logprob, top))
        state.prompt_logprobs = PromptLogprobs(state.request_id, start + 1, tuple(entries))
        row += count


def take_prompt_logprobs(
    scheduled: Sequence[tuple[RequestState, int]], failed: Sequence[FailedRequest]
) -> tuple[PromptLogprobs, ...]:
    """The step's scores off its requests' states, but a failed request's (its pass may have
    scored before it failed; it ends anyway)."""
    failed_ids = {failure.request_id for failure in failed}
    scores = []
    for state, _ in scheduled:
        if state.prompt_logprobs is not None and state.request_id not in failed_ids:
            scores.append(state.prompt_logprobs)
        state.prompt_logprobs = None
    return tuple(scores)
