"""The step contract between scheduler and engine-worker: one plan in, one result out.

New requests cross whole, once; running ones as diffs (new block ids, how many tokens to
compute). The worker keeps each request's tokens and block table between steps, and appends the
tokens it samples itself, so the plan never resends them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.sampling import SamplingParams


@dataclass(frozen=True)
class NewRequestPlan:
    """A request the worker has not seen (or must rebuild after preemption)."""

    request_id: str
    token_ids: tuple[int, ...]  # every known token: prompt, then output so far
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens whose K/V already sit in the cache (prefix hits)
    num_scheduled_tokens: int
    sampling: SamplingParams
    prompt_len: int  # penalties treat prompt and output tokens differently
    # Blocks a KV tier holds, loaded before the step computes: the full blocks that end at
    # num_computed_tokens, in order (services/engine_worker/kv_tiers/).
    load_hashes: tuple[int, ...] = ()
    draft_token_ids: ClassVar[tuple[int, ...]] = ()  # a request speculates once it decodes


# Built per request every step: slots and no frozen __setattr__ halve what one costs to make.
@dataclass(slots=True)
class RunningRequestPlan:
    """A request the worker already holds; only what changed since the last step."""

    request_id: str
    new_block_ids: tuple[int, ...]
    num_scheduled_tokens: int  # its last known token, plus its draft tokens
    # Speculative tokens the step verifies after the last known token (speculation.py).
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class BlockWrite:
    """A full, hashed pool block that goes down to the KV tiers."""

    block_id: int
    block_hash: int  # chained, with the tenant's salt
    token_ids: tuple[int, ...]  # stored beside it, re-checked on every load


@dataclass(frozen=True)
class StepPlan:
    """Everything one forward pass computes. Order is the batch order of the result."""

    step_id: int
    new_requests: tuple[NewRequestPlan, ...]
    running_requests: tuple[RunningRequestPlan, ...]
    finished_request_ids: tuple[str, ...]  # worker drops their state before this step runs
    # (source, destination) KV blocks the worker copies before this step runs: a fork's copy
    # of its sibling's partial prompt block.
    block_copies: tuple[tuple[int, int], ...] = ()
    # Blocks to copy down to the KV tiers before this step runs (it may overwrite them).
    block_writes: tuple[BlockWrite, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.running_requests
        )

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens it computes: new requests' and running chunks' (not drafts)."""
        running = self.running_requests
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens
            for r in running
            if r.num_scheduled_tokens > 1 + len(r.draft_token_ids)
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top alternatives, from the raw model distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)  # per request every step, as RunningRequestPlan
class SampledToken:
    """A request whose scheduled tokens reached its end this step, and the token sampled.

    A speculating request also gets its leading accepted draft tokens: its output grows by
    drafts[:num_accepted_drafts] and then token_id."""

    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None
    num_accepted_drafts: int = 0
    draft_logprobs: tuple[TokenLogprobs, ...] = ()  # of the accepted drafts, with logprobs on


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of a run of a request's prompt tokens, computed by one prefill chunk: entry i
    is prompt token first_position + i given the tokens before it (position 0 has none)."""

    request_id: str
    first_position: int
    logprobs: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class FailedRequest:
    """A request the step could not compute. It alone ends; the rest of the batch goes on."""

    request_id: str
    reason: str  # Reason.EXECUTION_FAILED or Reason.OUT_OF_MEMORY
    error_type: str  # the exception's class, for logs and spans; never shown to the client


@dataclass(frozen=True)
class LoadFailure:
    """A new request whose planned load stopped short: it computed nothing this step, and
    the tokens after `num_computed_tokens` (what did load, and its cached prefix) are
    recomputed in later steps."""

    request_id: str
    num_computed_tokens: int
    reason: str  # missing, unavailable, checksum, tokens, layout, truncated


@dataclass(frozen=True)
class StepResult:
    """What the worker returns for a plan; requests mid-prefill (chunked) sample nothing."""

    step_id: int
    sampled: tuple[SampledToken, ...]
    failed: tuple[FailedRequest, ...] = ()
    load_failures: tuple[LoadFailure, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # of requests that asked, chunk by chunk
