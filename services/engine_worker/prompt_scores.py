"""Prompt logprobs: the logprob of each prompt token given the ones before it, from the logits
of the prefill rows that computed them (evaluation harnesses score text this way).

A chunk's rows come after the step's sampled rows (`FlatBatch.logit_rows`); each chunk gives
one `PromptLogprobs` for the step's result.
"""

from __future__ import annotations

import torch

from services.engine_worker.step_inputs import FlatBatch
from shared.step import PromptLogprobs, TokenLogprobs


def score_prompts(logits: torch.Tensor, flat: FlatBatch) -> list[PromptLogprobs]:
    """logits: (len(flat.prompt_rows), vocab), in prompt_rows order. Row j of a chunk that
    starts at prompt position `start` scores prompt token start + j + 1."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    widest = max(state.sampling.prompt_logprobs or 0 for state, _, _ in flat.prompt_spans)
    top_values = top_ids = None
    if widest:
        top_values, top_ids = (t.tolist() for t in torch.topk(log_probs, widest))
    row, scores = 0, []
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
        scores.append(PromptLogprobs(state.request_id, start + 1, tuple(entries)))
        row += count
    return scores
