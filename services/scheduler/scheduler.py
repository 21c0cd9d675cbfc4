"""Continuous batching: `schedule()` spends a token budget into a StepPlan, `update()` closes it.

Each step: running requests first (decodes and unfinished prefill chunks, in priority order),
then waiting ones while budget, sequence slots and KV blocks last. When blocks run out the
lowest-priority, newest running request is preempted: its blocks are freed and it is recomputed
later (its cached full blocks usually make that cheap).

Tenants share the pool fairly within a priority: the next waiting request admitted is the
oldest of the tenant holding the fewest KV blocks per unit of its weight, and a preemption takes
the newest request of the tenant holding the most. A tenant that floods the queue waits behind
the others' requests, not in front of them; with one tenant this is plain FCFS.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.block_manager import BlockManager, PrefixMatch
from services.scheduler.request import Request, RequestStatus
from shared.config import CacheConfig, SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason, RequestOutput
from shared.sampling import SamplingParams
from shared.step import (
    FailedRequest,
    NewRequestPlan,
    RunningRequestPlan,
    StepPlan,
    StepResult,
)


@dataclass(frozen=True)
class SchedulerLoad:
    """Counts a caller can check from outside: queues, blocks, lifetime totals."""

    num_waiting: int
    num_waiting_tokens: int  # prompt tokens waiting requests still have to compute (estimated)
    num_running: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_hit_tokens: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.config = config
        self.block_size = cache.block_size
        # A request can never outgrow the whole pool, so the pool caps the context length too.
        self.max_model_len = min(max_model_len, num_blocks * cache.block_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()
        self._freed_since_last_plan: list[str] = []
        self.num_preemptions = 0
        self.num_finished = 0  # completed or aborted

    # ---- requests in and out -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        cache_salt: bytes = b"",
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> Request:
        if request_id in self.requests:
            raise KvmeshError(Reason.INVALID_ARGUMENT, f"request id {request_id!r} is in use")
        self._check_prompt_fits(len(prompt_token_ids))
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling,
            next(self._arrivals),
            priority,
            cache_salt,
            tenant,
            tenant_weight if tenant_weight > 0 else 1.0,
        )
        request.num_cached_on_arrival = self.block_manager.cached_prefix_tokens(request)
        self.requests[request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
        return request

    def _check_prompt_fits(self, prompt_len: int) -> None:
        if prompt_len == 0:
            raise KvmeshError(Reason.EMPTY_PROMPT, "the prompt has no tokens")
        if prompt_len >= self.max_model_len:
            raise KvmeshError(
                Reason.PROMPT_TOO_LONG,
                f"prompt of {prompt_len} tokens leaves no room to generate within "
                f"the context length {self.max_model_len}",
            )
        chunking = self.config.prefill_chunk_size is not None
        if not chunking and prompt_len > self.config.max_num_batched_tokens:
            raise KvmeshError(
                Reason.PROMPT_TOO_LONG,
                f"prompt of {prompt_len} tokens exceeds the step budget of "
                f"{self.config.max_num_batched_tokens} and chunked prefill is off",
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its blocks are free before the next plan is built."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        return self._finish(request, FinishReason.FINISH_REASON_ABORT, ())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> SchedulerLoad:
        return SchedulerLoad(
            len(self.waiting),
            sum(r.num_tokens - r.num_cached_on_arrival for r in self.waiting),
            len(self.running),
            self.block_manager.num_free_blocks,
            self.block_manager.num_blocks,
            self.num_preemptions,
            self.block_manager.stats.hits,
        )

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._preempt_for_fair_share()
        budget = self.config.max_num_batched_tokens
        new_plans: list[NewRequestPlan] = []
        running_plans: list[RunningRequestPlan] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._tokens_to_schedule(request, budget)
            if num_new == 0:
                index += 1
                continue
            num_blocks_before = len(request.block_ids)
            while not self.block_manager.allocate(request, num_new):
                preempted = True
                victim = self._preemption_victim(index)
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            running_plans.append(
                RunningRequestPlan(
                    request.request_id, tuple(request.block_ids[num_blocks_before:]), num_new
                )
            )
            budget -= num_new
            index += 1
        # A step that had to preempt admits nothing new: the pool is already too tight.
        held = self._blocks_by_tenant()
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self._next_waiting(held)
            prefix = self.block_manager.match_prefix(request)
            request.num_computed_tokens = prefix.num_tokens
            num_new = self._tokens_to_schedule(request, budget)
            if num_new == 0 or not self.block_manager.allocate(request, num_new, prefix):
                request.num_computed_tokens = 0
                break
            self._admit(request, prefix)
            held[request.tenant] = held.get(request.tenant, 0) + len(request.block_ids)
            new_plans.append(
                NewRequestPlan(
                    request.request_id,
                    tuple(request.token_ids),
                    tuple(request.block_ids),
                    request.num_computed_tokens,
                    num_new,
                    request.sampling,
                    request.prompt_len,
                )
            )
            budget -= num_new
        freed, self._freed_since_last_plan = tuple(self._freed_since_last_plan), []
        return StepPlan(next(self._step_ids), tuple(new_plans), tuple(running_plans), freed)

    def _blocks_by_tenant(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for request in self.running:
            held[request.tenant] = held.get(request.tenant, 0) + len(request.block_ids)
        return held

    def _next_waiting(self, held: dict[str, int]) -> Request:
        """The oldest waiting request of the most urgent priority whose tenant holds the
        fewest blocks per unit of weight (ties: the oldest)."""
        head = self.waiting[0]
        best, best_share = head, held.get(head.tenant, 0) / head.tenant_weight
        seen = {head.tenant}
        for request in self.waiting[1:]:
            if request.priority != head.priority:
                break
            if request.tenant in seen:
                continue
            seen.add(request.tenant)
            share = held.get(request.tenant, 0) / request.tenant_weight
            if share < best_share:
                best, best_share = request, share
        return best

    def _preempt_for_fair_share(self) -> None:
        """When the batch is full, a waiting request of a tenant below its share takes the
        room of the newest running request of the tenant furthest above it (never one more
        urgent than itself): a flooding tenant holding every slot gives one back, at most one
        per step, while the other tenant would still hold less than it after the move."""
        if not self.waiting:
            return
        held = self._blocks_by_tenant()
        candidate = self._next_waiting(held)
        needed = self.block_manager.blocks_needed(candidate.num_tokens)
        full = len(self.running) >= self.config.max_num_seqs
        if not full and needed <= self.block_manager.num_free_blocks:
            return
        others = [
            r
            for r in self.running
            if r.tenant != candidate.tenant and r.priority >= candidate.priority
        ]
        if not others:
            return

        def share(request: Request) -> tuple[float, int]:
            return (held.get(request.tenant, 0) / request.tenant_weight, request.arrival_seq)

        victim = max(others, key=share)
        candidate_after = (held.get(candidate.tenant, 0) + needed) / candidate.tenant_weight
        victim_after = (held[victim.tenant] - len(victim.block_ids)) / victim.tenant_weight
        if victim_after >= candidate_after:
            self._preempt(victim)

    def _preemption_victim(self, first_unscheduled: int) -> Request:
        """Among the least urgent running requests not yet scheduled this step: the newest
        of the tenant holding the most blocks per unit of weight."""
        candidates = self.running[first_unscheduled:]
        lowest = candidates[-1].priority
        held = self._blocks_by_tenant()

        def share(request: Request) -> tuple[float, int]:
            return (held.get(request.tenant, 0) / request.tenant_weight, request.arrival_seq)

        return max((r for r in candidates if r.priority == lowest), key=share)

    def _tokens_to_schedule(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        chunk = self.config.prefill_chunk_size
        if chunk is not None:
            return min(remaining, budget, chunk) if remaining > 1 else min(remaining, budget)
        return remaining if remaining <= budget else 0  # unchunked prefill goes whole or waits

    def _admit(self, request: Request, prefix: PrefixMatch) -> None:
        self.waiting.remove(request)
        if request.num_preemptions == 0:
            request.num_cached_tokens = prefix.num_tokens
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._freed_since_last_plan.append(request.request_id)
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Advance counters by what the plan computed, append sampled tokens, finish requests."""
        # Failures first: a failed request's blocks must not be cached as computed below.
        outputs = [self._fail(f) for f in result.failed if f.request_id in self.requests]
        sampled = {s.request_id: s for s in result.sampled}
        scheduled = [(p.request_id, p.num_scheduled_tokens) for p in plan.new_requests]
        scheduled += [(p.request_id, p.num_scheduled_tokens) for p in plan.running_requests]
        for request_id, num_scheduled in scheduled:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.num_computed_tokens += num_scheduled
            self.block_manager.cache_full_blocks(request)
            token = sampled.get(request_id)
            if token is None:
                continue
            request.token_ids.append(token.token_id)
            logprobs = (token.logprobs,) if token.logprobs is not None else ()
            reason = self._stop_reason(request, token.token_id)
            if reason is None:
                outputs.append(RequestOutput(request_id, (token.token_id,), logprobs))
            else:
                self.running.remove(request)
                outputs.append(self._finish(request, reason, (token.token_id,), logprobs))
        return outputs

    def _fail(self, failure: FailedRequest) -> RequestOutput:
        """The worker could not compute it: it ends now, and none of its blocks stays in the
        prefix cache (what the failed pass wrote there may be garbage)."""
        request = self.requests.pop(failure.request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request, drop_cached=True)
        self.num_finished += 1
        request.status = RequestStatus.FINISHED
        self._freed_since_last_plan.append(request.request_id)
        return RequestOutput(
            request.request_id, (), num_cached_tokens=request.num_cached_tokens, failure=failure
        )

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        sampling = request.sampling
        if token_id in self.eos_token_ids and not sampling.ignore_eos:
            return FinishReason.FINISH_REASON_STOP
        if token_id in sampling.stop_token_ids:
            return FinishReason.FINISH_REASON_STOP
        if request.num_output_tokens >= sampling.max_tokens:
            return FinishReason.FINISH_REASON_LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.FINISH_REASON_LENGTH
        return None

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        new_token_ids: tuple[int, ...],
        logprobs: tuple = (),
    ) -> RequestOutput:
        self.block_manager.free(request)
        self.num_finished += 1
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._freed_since_last_plan.append(request.request_id)
        return RequestOutput(
            request.request_id, new_token_ids, logprobs, reason, request.num_cached_tokens
        )
