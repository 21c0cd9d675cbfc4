"""What one step computes, whatever the backend: each request's state between steps, and the
step's scheduled requests flattened once into token rows.

Row order: decodes (one new token each) first, then prefill chunks, each request's tokens
contiguous. The torch batch (batch.py) and the GPU batch (gpu_batch.py) are both built from
one `FlatBatch`, so the two backends never disagree on which row is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance

from shared.sampling import SamplingParams
from shared.step import NewRequestPlan


@dataclass
class RequestState:
    """What the worker remembers of a request between steps."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    prompt_len: int
    matcher: llguidance.LLMatcher | None = None  # a response format's state, if it has one

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @classmethod
    def from_plan(cls, new: NewRequestPlan) -> RequestState:
        """The one place a planned request becomes the worker's state (its matcher, if it
        has a response format, is the worker's to attach: it needs the grammar compiler)."""
        return cls(
            new.request_id,
            list(new.token_ids),
            list(new.block_ids),
            new.num_computed_tokens,
            new.sampling,
            new.prompt_len,
        )


@dataclass
class FlatBatch:
    input_ids: list[int] = field(default_factory=list)  # (T,)
    positions: list[int] = field(default_factory=list)  # (T,)
    token_blocks: list[int] = field(default_factory=list)  # (T,) the block each row writes
    decode_blocks: list[list[int]] = field(default_factory=list)  # (D,) blocks up to its token
    decode_context_lens: list[int] = field(default_factory=list)  # (D,)
    prefill_starts: list[int] = field(default_factory=list)  # (P,) tokens already cached
    prefill_blocks: list[list[int]] = field(default_factory=list)  # (P,) blocks of its context
    prefill_query_starts: list[int] = field(default_factory=list)  # (P + 1,) first row of each
    prefill_context_lens: list[int] = field(default_factory=list)  # (P,)
    sample_rows: list[int] = field(default_factory=list)  # (S,) rows whose logits are sampled
    sampling_states: list[RequestState] = field(default_factory=list)  # (S,) in row order

    def _add_rows(self, state: RequestState, start: int, stop: int, block_size: int) -> None:
        self.input_ids += state.token_ids[start:stop]
        self.positions += range(start, stop)
        self.token_blocks += [state.block_ids[p // block_size] for p in range(start, stop)]
        if stop == len(state.token_ids):  # its last known token: the next one is sampled
            self.sample_rows.append(len(self.input_ids) - 1)
            self.sampling_states.append(state)


def flatten(scheduled: list[tuple[RequestState, int]], block_size: int) -> FlatBatch:
    """`scheduled`: (request, tokens to compute this step), in plan order. A prompt's last token
    computed alone (the rest cached, or chunked) is a prefill, not a decode: a cold prefill
    computes that token with prefill attention, and a cached one must give the same bits."""
    flat = FlatBatch()
    decoding = [n == 1 and s.num_computed_tokens >= s.prompt_len for s, n in scheduled]
    decodes = [pair for pair, decode in zip(scheduled, decoding, strict=True) if decode]
    prefills = [pair for pair, decode in zip(scheduled, decoding, strict=True) if not decode]
    for state, _ in decodes:
        position = state.num_computed_tokens
        flat._add_rows(state, position, position + 1, block_size)
        flat.decode_blocks.append(state.block_ids[: position // block_size + 1])
        flat.decode_context_lens.append(position + 1)
    flat.prefill_query_starts.append(len(flat.input_ids))
    for state, num_new in prefills:
        start = state.num_computed_tokens
        context = start + num_new
        flat._add_rows(state, start, context, block_size)
        flat.prefill_starts.append(start)
        flat.prefill_blocks.append(state.block_ids[: -(-context // block_size)])
        flat.prefill_query_starts.append(len(flat.input_ids))
        flat.prefill_context_lens.append(context)
    return flat
