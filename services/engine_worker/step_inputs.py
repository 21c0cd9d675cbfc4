"""What one step computes, whatever the backend: each request's state between steps, and the
step's scheduled requests flattened once into token rows.

Row order: decode rows (one per token past the prompt: a new token, a draft to verify, or an
output recomputed after preemption) first, then prefill chunks of prompts, each request's rows
contiguous. The torch batch (torch_backend/batch.py) and the GPU batch (cupy_backend/batch.py)
are both built from one `FlatBatch`, so the two backends never disagree on which row is which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import numpy

from shared.sampling import SamplingParams
from shared.sliding_window import window_span
from shared.step import NewRequestPlan, RunningRequestPlan


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
    num_drafts: int = 0  # draft tokens at the end of token_ids, verified by this step
    speculated: bool = False  # this step's plan gave it drafts (a response format may take all)
    slot: int = -1  # its row of the worker's block tables (persistent_batch.py); -1: none
    # A sliding-window model's sliding layers: a window block per block of its context, the
    # null block behind its window (window_blocks.py).
    window_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def apply(self, plan: RunningRequestPlan) -> int:
        """A step's plan for it: its new blocks, and the draft tokens to verify after its last
        known one, less any its response format forbids (the proposal ends there). Returns
        the tokens to compute."""
        self.block_ids += plan.new_block_ids
        drafts = plan.draft_token_ids
        if not drafts:
            return plan.num_scheduled_tokens
        if self.matcher is not None:
            drafts = drafts[: self.matcher.validate_tokens(list(drafts))]
        self.token_ids += drafts
        self.num_drafts, self.speculated = len(drafts), True
        return plan.num_scheduled_tokens - len(plan.draft_token_ids) + len(drafts)

    def settle_drafts(self, accepted: int, block_size: int) -> None:
        """After a step that verified drafts: the rejected ones leave its tokens and computed
        count, and the blocks past its computed tokens leave its table (the scheduler frees
        them alike)."""
        if not self.speculated:
            return
        rejected = self.num_drafts - accepted
        del self.token_ids[len(self.token_ids) - rejected :]
        self.num_computed_tokens -= rejected
        del self.block_ids[-(-self.num_computed_tokens // block_size) :]
        self.num_drafts, self.speculated = 0, False

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
    # (D, widest) each decode row's blocks up to its token, zero-padded
    decode_table: numpy.ndarray = field(default_factory=lambda: numpy.zeros((0, 1), numpy.int32))
    decode_context_lens: list[int] = field(default_factory=list)  # (D,)
    # Whether a request has several decode rows (drafts, a recompute): a later one reads the
    # earlier ones' K/V, which must be in the pool before its attention.
    chained_decodes: bool = False
    prefill_starts: list[int] = field(default_factory=list)  # (P,) tokens already cached
    prefill_blocks: list[list[int]] = field(default_factory=list)  # (P,) blocks of its context
    prefill_query_starts: list[int] = field(default_factory=list)  # (P + 1,) first row of each
    prefill_context_lens: list[int] = field(default_factory=list)  # (P,)
    sample_rows: list[int] = field(default_factory=list)  # (S,) rows whose logits are sampled
    sampling_states: list[RequestState] = field(default_factory=list)  # (S,) in row order
    # Prefill rows whose logits score the next prompt token, after the sampled rows, for the
    # requests that ask for prompt logprobs: (state, chunk start position, rows) per chunk.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[RequestState, int, int]] = field(default_factory=list)
    # The sliding layers' own blocks where they keep their window only, as the three above:
    # (T,) written, (D, widest) decode tables, (P,) prefill blocks.
    window_token_blocks: list[int] = field(default_factory=list)
    window_decode_table: numpy.ndarray = field(
        default_factory=lambda: numpy.zeros((0, 1), numpy.int32)
    )
    window_prefill_blocks: list[list[int]] = field(default_factory=list)

    @property
    def logit_rows(self) -> list[int]:
        """The rows the model computes logits for: the sampled ones, then the scoring ones."""
        return self.sample_rows + self.prompt_rows if self.prompt_rows else self.sample_rows

    def _add_rows(self, state: RequestState, start: int, stop: int, block_size: int) -> None:
        self.input_ids += state.token_ids[start:stop]
        self.positions += range(start, stop)
        self.token_blocks += [state.block_ids[p // block_size] for p in range(start, stop)]
        # Its last token samples the next one; a draft's row is compared with it too.
        if stop > len(state.token_ids) - 1 - state.num_drafts:
            self.sample_rows.append(len(self.input_ids) - 1)
            self.sampling_states.append(state)


def flatten(
    scheduled: list[tuple[RequestState, int]],
    block_size: int,
    tables: numpy.ndarray | None = None,
    window: int = 0,
) -> FlatBatch:
    """`scheduled`: (request, tokens to compute this step), in plan order; `tables`: the
    worker's block tables, rows by `RequestState.slot` (persistent_batch.py).

    A token past the prompt is always a decode row of its own over the tokens before it, and
    a prompt token always a prefill row: whether the token is decoded the first time, verified
    as a draft, or recomputed after preemption, its row computes the same bits (decode rows do
    not depend on their batch; prefills over cached blocks give a cold prefill's bits, see
    attention.py). So a preempted request resumes with the tokens it would have produced, and
    drafts change no greedy output. `window` > 0: the sliding layers' window, whose rows are
    built too, from the requests' window_ids."""
    flat = FlatBatch()
    decode_states: list[RequestState] = []
    decode_num_blocks: list[int] = []
    for state, num_new in scheduled:
        start, stop = state.num_computed_tokens, state.num_computed_tokens + num_new
        if num_new == 1 and start == len(state.token_ids) - 1 >= state.prompt_len:
            # A plain decode (the steady case): _add_rows's row, without its loop.
            flat.input_ids.append(state.token_ids[start])
            flat.positions.append(start)
            flat.token_blocks.append(state.block_ids[start // block_size])
            flat.sample_rows.append(len(flat.input_ids) - 1)
            flat.sampling_states.append(state)
            decode_states.append(state)
            decode_num_blocks.append(start // block_size + 1)
            flat.decode_context_lens.append(stop)
            continue
        first_decode = max(start, state.prompt_len)
        flat.chained_decodes |= stop - first_decode > 1
        for position in range(first_decode, stop):
            flat._add_rows(state, position, position + 1, block_size)
            decode_states.append(state)
            decode_num_blocks.append(position // block_size + 1)
            flat.decode_context_lens.append(position + 1)
    if decode_states:
        flat.decode_table = gather_tables(tables, decode_states, decode_num_blocks)
    flat.prefill_query_starts.append(len(flat.input_ids))
    for state, num_new in scheduled:
        start = state.num_computed_tokens
        context = min(start + num_new, state.prompt_len)
        if context <= start:
            continue
        first_row = len(flat.input_ids)
        flat._add_rows(state, start, context, block_size)
        scored = min(context, state.prompt_len - 1) - start  # rows whose next token is prompt
        if state.sampling.prompt_logprobs is not None and scored > 0:
            flat.prompt_rows += range(first_row, first_row + scored)
            flat.prompt_spans.append((state, start, scored))
        flat.prefill_starts.append(start)
        flat.prefill_blocks.append(state.block_ids[: -(-context // block_size)])
        flat.prefill_query_starts.append(len(flat.input_ids))
        flat.prefill_context_lens.append(context)
        if window:
            flat.window_prefill_blocks.append(state.window_ids[: -(-context // block_size)])
    if window:
        _window_rows(flat, scheduled, decode_states, decode_num_blocks, block_size, window)
    return flat


def _window_rows(
    flat: FlatBatch,
    scheduled: list[tuple[RequestState, int]],
    decode_states: list[RequestState],
    decode_num_blocks: list[int],
    block_size: int,
    window: int,
) -> None:
    """The window blocks each row writes and each decode row reads: rows are in flatten's
    order, each request's decode rows then its prefill rows, each run in position order. A
    decode row's table holds its window's blocks only: the rest is the null block (0) anyway."""
    owners = list(decode_states)
    for state, num_new in scheduled:
        start = state.num_computed_tokens
        owners += [state] * max(0, min(start + num_new, state.prompt_len) - start)
    flat.window_token_blocks = [
        state.window_ids[position // block_size]
        for state, position in zip(owners, flat.positions, strict=True)
    ]
    if decode_states:
        width = max(decode_num_blocks)
        table = numpy.zeros((len(decode_states), width), dtype=numpy.int32)
        rows = zip(decode_states, flat.decode_context_lens, strict=True)
        for row, (state, context) in enumerate(rows):  # one query, at position context - 1
            first, stop = window_span(context - 1, context, window, block_size)
            table[row, first:stop] = state.window_ids[first:stop]
        flat.window_decode_table = table


def gather_tables(
    tables: numpy.ndarray | None, states: Sequence[RequestState], num_blocks: Sequence[int]
) -> numpy.ndarray:
    """(len(states), widest) int32: each state's first num_blocks blocks, zeros after; from
    its row of `tables` when it has one, else from its list (a warm-up's or a fixture's)."""
    width = max(num_blocks)
    counts = numpy.asarray(num_blocks, dtype=numpy.int64)
    slots = numpy.fromiter((s.slot for s in states), dtype=numpy.int64, count=len(states))
    if tables is None or width > tables.shape[1]:
        slots[:] = -1
        table = numpy.zeros((len(states), width), dtype=numpy.int32)
    else:
        table = tables[slots, :width]  # a copy: fancy indexing
    table[numpy.arange(width)[None, :] >= counts[:, None]] = 0
    for row in numpy.flatnonzero(slots < 0).tolist():
        table[row, : counts[row]] = states[row].block_ids[: counts[row]]
    return table


def unique_states(states: Sequence[RequestState]) -> tuple[RequestState, ...]:
    """Each request once, in row order (a speculating request samples several rows, together)."""
    unique: list[RequestState] = []
    for state in states:
        if not unique or unique[-1] is not state:
            unique.append(state)
    return tuple(unique)
