"""Scheduler-side state of one request: progress counters, not phase flags."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from enum import Enum

from shared.block_hash import ROOT_HASH, hash_block
from shared.config import SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason, RequestOutput
from shared.sampling import SamplingParams
from shared.step import NewRequestPlan, TokenLogprobs


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from scratch
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """`num_computed_tokens` catches up with `num_tokens`; prefill and decode are the same loop.

    token_ids holds the prompt then every sampled token; the newest sampled token has no K/V yet,
    so a running request always has exactly one token left to compute after a step.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    arrival_seq: int
    priority: int = 0  # lower runs first, as in vLLM
    cache_salt: bytes = b""
    tenant: str = ""  # its fair share is counted with the tenant's other requests
    tenant_weight: float = 1.0
    group_id: str = ""  # the n completions of one request share it, and the prompt's K/V
    prompt_len: int = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_cached_on_arrival: int = 0  # the hit it would have had on arrival (a load estimate)
    num_tier_blocks: int = 0  # leading full blocks its worker's KV tiers held on arrival
    num_loaded_tokens: int = 0  # prompt tokens loaded from a KV tier at admission
    loading: bool = False  # its planned load has not come back yet (the step runs it)
    # Prefill/decode split: a prefill-only request's blocks are held under a lease once it has
    # its first token; a handed-over one loads its prompt blocks pulled from the prefill worker.
    prefill_only: bool = False
    handed_over: bool = False
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative tokens proposed for it, and accepted
    num_accepted_drafts: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, chained
    num_window_blocks: int = 0  # its sliding layers' blocks on the worker (window_budget.py)
    # Leading blocks cache_full_blocks has looked at since it last got blocks: each is looked
    # at once, when it fills, not on every step after.
    num_hashed_blocks: int = 0
    # Planning ahead (Scheduler.assume): steps planned but not yet updated, oldest first, each
    # (tokens it computes, tokens it samples); counted in num_computed_tokens already, and the
    # tokens they will sample (not yet in token_ids) in num_pending_tokens.
    in_flight: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    num_in_flight_tokens: int = 0
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # What ends it (fold_stops): a token of stop_ids (EOS unless ignored, its stop tokens), or
    # reaching max_length tokens (max_tokens of output, or the context length).
    stop_ids: frozenset[int] = frozenset()
    max_length: int = 0
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_confirmed_tokens(self) -> int:
        """Computed tokens whose step has come back (not those of a step planned ahead)."""
        return self.num_computed_tokens - self.num_in_flight_tokens

    @property
    def num_pooled_tokens(self) -> int:
        """Computed tokens whose K/V surely sit in its blocks: not a load or a step still in
        flight, which may fall short (what a sibling may fork from)."""
        loading = self.num_loaded_tokens if self.loading else 0
        return self.num_confirmed_tokens - loading

    def assume(self, num_scheduled: int) -> None:
        """Its part of a plan counted as computed before the step comes back (planning one
        step ahead); a step that reaches its last token samples one more."""
        self.num_computed_tokens += num_scheduled
        samples = int(self.num_computed_tokens == len(self.token_ids) + self.num_pending_tokens)
        self.num_pending_tokens += samples
        self.num_in_flight_tokens += num_scheduled
        self.in_flight.append((num_scheduled, samples))

    def unassume(self) -> None:
        """The oldest assumed step came back: its count leaves the in-flight ones and the
        computed count, for the update to add what it did compute."""
        num_scheduled, samples = self.in_flight.popleft()
        self.num_computed_tokens -= num_scheduled
        self.num_in_flight_tokens -= num_scheduled
        self.num_pending_tokens -= samples

    def forget_in_flight(self) -> None:
        """Preempted or ended: what steps in flight compute for it is never read."""
        self.in_flight.clear()
        self.num_in_flight_tokens = self.num_pending_tokens = 0

    @property
    def certainly_done(self) -> bool:
        """Its pending tokens reach max_tokens or the context length: it ends with them, and
        a step planned for it now would be wasted."""
        pending = self.num_pending_tokens
        return pending > 0 and len(self.token_ids) + pending >= self.max_length

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def fold_stops(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """What ends it, worked out once (Scheduler.add_request): stop_reason's two checks."""
        sampling = self.sampling
        eos = frozenset() if sampling.ignore_eos else eos_token_ids
        self.stop_ids = eos | frozenset(sampling.stop_token_ids)
        self.max_length = min(self.prompt_len + sampling.max_tokens, max_model_len)

    def stop_reason(self, token_id: int) -> FinishReason | None:
        """Whether the token just appended ends it, and why."""
        if token_id in self.stop_ids:
            return FinishReason.FINISH_REASON_STOP
        if len(self.token_ids) >= self.max_length:
            return FinishReason.FINISH_REASON_LENGTH
        return None

    def append_output(
        self,
        token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprobs, ...],
    ) -> tuple[tuple[int, ...], tuple[TokenLogprobs, ...], FinishReason | None]:
        """Appends a step's tokens (accepted drafts, then the sampled one) up to the first that
        ends it: the tokens and logprobs appended, and why it ended, if it did."""
        for count, token_id in enumerate(token_ids, 1):
            self.token_ids.append(token_id)
            reason = self.stop_reason(token_id)
            if reason is not None:
                return token_ids[:count], logprobs[:count], reason
        return token_ids, logprobs, None

    def final_output(
        self, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...]
    ) -> RequestOutput:
        """Its last output, once finish_reason is set: with its cache and draft counts."""
        return RequestOutput(
            self.request_id,
            token_ids,
            logprobs,
            self.finish_reason,
            self.num_cached_tokens,
            num_loaded_tokens=self.num_loaded_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_drafts=self.num_accepted_drafts,
        )

    @property
    def num_shareable_tokens(self) -> int:
        """What a sibling's K/V can give it: the prompt, leaving at least one token to compute
        (the step that samples needs logits)."""
        return min(self.prompt_len, self.num_tokens - 1)

    def new_plan(
        self, num_scheduled_tokens: int, load_hashes: tuple[int, ...] = ()
    ) -> NewRequestPlan:
        """The whole request, for a worker that has not seen it (or must rebuild it)."""
        return NewRequestPlan(
            self.request_id,
            tuple(self.token_ids),
            tuple(self.block_ids),
            self.num_computed_tokens,
            num_scheduled_tokens,
            self.sampling,
            self.prompt_len,
            load_hashes,
        )

    def tokens_to_schedule(self, budget: int, chunk: int | None) -> int:
        """What a step with `budget` tokens left computes of it: a chunk of its prompt (when
        prefill is chunked), else all it lacks or nothing (unchunked prefill goes whole)."""
        remaining = len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens
        if chunk is not None:
            return min(remaining, budget, chunk) if remaining > 1 else min(remaining, budget)
        return remaining if remaining <= budget else 0

    @property
    def sort_key(self) -> tuple[int, int]:
        """Queue order: priority first, then arrival (FCFS)."""
        return (self.priority, self.arrival_seq)

    def full_block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of every full block of known tokens, extended incrementally."""
        num_full = len(self.token_ids) // block_size
        parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        for index in range(len(self.block_hashes), num_full):
            start = index * block_size
            parent = hash_block(parent, self.token_ids[start : start + block_size], self.cache_salt)
            self.block_hashes.append(parent)
        return self.block_hashes


def check_prompt_fits(prompt_len: int, max_model_len: int, config: SchedulerConfig) -> None:
    """A prompt that could never run is refused on arrival, not left waiting."""
    if prompt_len == 0:
        raise KvmeshError(Reason.EMPTY_PROMPT, "the prompt has no tokens")
    if prompt_len >= max_model_len:
        raise KvmeshError(
            Reason.PROMPT_TOO_LONG,
            f"prompt of {prompt_len} tokens leaves no room to generate within "
            f"the context length {max_model_len}",
        )
    if config.prefill_chunk_size is None and prompt_len > config.max_num_batched_tokens:
        raise KvmeshError(
            Reason.PROMPT_TOO_LONG,
            f"prompt of {prompt_len} tokens exceeds the step budget of "
            f"{config.max_num_batched_tokens} and chunked prefill is off",
        )
