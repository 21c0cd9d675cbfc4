"""Continuous batching: `schedule()` spends a token budget into a StepPlan, `update()` closes it.

Each step: running requests first (decodes and unfinished prefill chunks, in priority order),
then waiting ones while budget, sequence slots and KV blocks last. When blocks run out the
lowest-priority, newest running request is preempted: its blocks are freed and it is recomputed
later (its cached full blocks usually make that cheap). Tenants share the batch and the pool by
weight (fair_share.py); n completions fork one prompt (groups.py); drafts are verified beside a
decode (speculation.py). A prefill-only request's blocks outlive it under a lease (`leases`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from services.scheduler.block_manager import BlockManager, PrefixMatch
from services.scheduler.fair_share import TenantShares
from services.scheduler.groups import Groups
from services.scheduler.prompt_scores import PromptScores
from services.scheduler.request import Request, RequestStatus, check_prompt_fits
from services.scheduler.result_updates import ResultUpdates
from services.scheduler.scheduler_load import SchedulerLoad
from services.scheduler.speculation import Speculator
from services.scheduler.tier_loads import NO_TIERS, TierLoads, TierPolicy
from services.scheduler.window_budget import WindowBudget
from shared.config import CacheConfig, SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason, RequestOutput
from shared.sampling import SamplingParams
from shared.sliding_window import WindowPool
from shared.step import (
    NewRequestPlan,
    RunningRequestPlan,
    StepPlan,
)


class Scheduler(ResultUpdates):
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        tiers: TierPolicy = NO_TIERS,
        window: WindowPool | None = None,
    ) -> None:
        """`window`: a sliding-window model's window blocks. Their K/V behind each request's
        position is freed, so no prefix (cached or a sibling's) can be reused with them."""
        self.config = config
        self.block_size = cache.block_size
        # A request can never outgrow the whole pool, so the pool caps the context length too.
        self.max_model_len = min(max_model_len, num_blocks * cache.block_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching and window is None,
            tiers.write_policy,
            WindowBudget(window, cache.block_size) if window else None,
        )
        self.tier_loads = TierLoads(tiers, cache.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self.groups = Groups(shares_kv=window is None)
        # A prompt goes in pieces whose window spans fit the window pool.
        self.chunk_size = config.prefill_chunk_size
        if window and window.most_step_tokens(self.block_size) < config.max_num_batched_tokens:
            self.chunk_size = min(
                self.chunk_size or config.max_num_batched_tokens,
                window.most_step_tokens(self.block_size),
            )
        self.prompt_scores = PromptScores()
        self.speculator = Speculator(config.speculative, self.block_manager, self.max_model_len)
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()
        self._freed_since_last_plan: list[str] = []
        self.leases: dict[str, Request] = {}  # prefilled, blocks held for a decode pair's pull
        self.num_preemptions = 0
        self.num_finished = 0  # completed or aborted

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        cache_salt: bytes = b"",
        tenant: str = "",
        tenant_weight: float = 1.0,
        group_id: str = "",
        num_tier_blocks: int = 0,
    ) -> Request:
        if request_id in self.requests:
            raise KvmeshError(Reason.INVALID_ARGUMENT, f"request id {request_id!r} is in use")
        check_prompt_fits(len(prompt_token_ids), self.max_model_len, self.config)
        weight = tenant_weight if tenant_weight > 0 else 1.0
        fields = (next(self._arrivals), priority, cache_salt, tenant, weight, group_id)
        request = Request(request_id, list(prompt_token_ids), sampling, *fields)
        request.fold_stops(self.eos_token_ids, self.max_model_len)
        request.num_cached_on_arrival = self.block_manager.cached_prefix_tokens(request)
        request.num_tier_blocks = num_tier_blocks
        self.requests[request_id] = request
        self.groups.add(request)
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its blocks are free before the next plan is built."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, FinishReason.FINISH_REASON_ABORT, ())

    def release_lease(self, request_id: str) -> None:
        """A prefilled request's blocks go back (handed over, or its lease expired)."""
        if (request := self.leases.pop(request_id, None)) is not None:
            self.block_manager.free(request)
            self._freed_since_last_plan.append(request_id)

    def has_unfinished(self) -> bool:
        """Requests to run, or blocks to write down to the KV tiers (then a plan of their own)."""
        return bool(self.waiting or self.running or self.block_manager.has_writes)

    def load(self) -> SchedulerLoad:
        return SchedulerLoad.of(
            self.waiting, self.running, self.block_manager, self.num_preemptions
        )

    def schedule(self) -> StepPlan:
        # The waiting, less group members whose sibling still computes their prompt. Taken
        # once a step: a request this step preempts waits for the next one anyway.
        admissible = [r for r in self.waiting if not (r.group_id and self.groups.is_held(r))]
        manager = self.block_manager
        free, needed = manager.num_free_blocks, manager.blocks_needed
        # Tenant shares matter only to a request that waits: a steady batch never counts them.
        if admissible and (
            victim := self._shares().slot_victim(admissible, self.running, free, needed)
        ):
            self._preempt(victim)
        budget = self.config.max_num_batched_tokens
        new_plans: list[NewRequestPlan] = []
        # A tenant below its share gets its prefill in a step of its own, not behind the
        # others' decodes (when it is admitted at all; else the running go on).
        prefill_first = (
            self.config.fair_prefill_first
            and bool(admissible)
            and self._shares().jumps(admissible, self.running, self.config.max_num_seqs)
        )
        running_plans, budget, preempted = (
            ([], budget, False) if prefill_first else self._schedule_running(budget)
        )
        # A step that had to preempt admits nothing new: the pool is already too tight.
        copies: list[tuple[int, int]] = []
        shares = self._shares() if admissible and not preempted else None
        while (
            shares is not None
            and admissible
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = shares.next_waiting(admissible)
            admissible.remove(request)
            if request.sampling.prompt_logprobs is not None:  # scores every prompt token
                prefix = PrefixMatch(block_size=self.block_size, from_cache=False)
            else:
                fork = self.groups.fork(request, self.block_size)
                if fork is None and self.groups.is_held(request):
                    continue  # a sibling admitted just now computes its prompt
                prefix = fork or self.block_manager.match_prefix(request)
                if fork is not None and request.num_preemptions:  # its own output is cached
                    cached = self.block_manager.match_prefix(request)
                    prefix = cached if cached.num_tokens > fork.num_tokens else fork
            loads = self.tier_loads.plan(request, prefix)
            request.num_computed_tokens = prefix.num_tokens + len(loads) * self.block_size
            num_new = request.tokens_to_schedule(budget, self.chunk_size)
            if num_new == 0 or not self.block_manager.allocate(request, num_new, prefix):
                request.num_computed_tokens = 0
                break
            if prefix.copy_from is not None:
                copies.append((prefix.copy_from, request.block_ids[len(prefix.block_ids)]))
            self._admit(request, prefix)
            self.tier_loads.admitted(request, loads)
            shares.add(request)
            new_plans.append(request.new_plan(num_new, loads))
            budget -= num_new
        if prefill_first and not new_plans:
            running_plans, budget, preempted = self._schedule_running(budget)
        freed, self._freed_since_last_plan = tuple(self._freed_since_last_plan), []
        return StepPlan(
            next(self._step_ids),
            tuple(new_plans),
            tuple(running_plans),
            freed,
            tuple(copies),
            self.block_manager.take_writes(),
        )

    def _schedule_running(self, budget: int) -> tuple[list[RunningRequestPlan], int, bool]:
        """Decodes and unfinished prefill chunks of the running, in priority order, preempting
        the least urgent when blocks run out: the plans, the budget left, whether it preempted."""
        plans: list[RunningRequestPlan] = []
        preempted = False
        index = 0
        running, block_size = self.running, self.block_size
        speculates = self.speculator.proposer is not None
        while index < len(running) and budget > 0:
            request = running[index]
            computed = request.num_computed_tokens
            if request.loading or request.certainly_done:
                index += 1  # planned ahead: its load comes back first, or it ends already
                continue
            if (
                len(request.token_ids) + request.num_pending_tokens - computed == 1
                and computed < len(request.block_ids) * block_size
                and not speculates
            ):  # a decode whose token has its slot already: what the general path gives it
                if window := self.block_manager.window:  # its span moved on by a position
                    window.hold(request, window.span(request, 1))
                plans.append(RunningRequestPlan(request.request_id, (), 1))
                budget -= 1
                index += 1
                continue
            num_new = request.tokens_to_schedule(budget, self.chunk_size)
            if num_new == 0:
                index += 1
                continue
            drafts = self.speculator.drafts(request, num_new, budget, len(running))
            num_new += len(drafts)
            num_blocks_before = len(request.block_ids)
            while not self.block_manager.allocate(request, num_new):
                preempted = True
                unscheduled = running[index:]
                self._preempt(self._shares().victim_among(unscheduled))
                if request.status is not RequestStatus.RUNNING:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            new_blocks = tuple(request.block_ids[num_blocks_before:])
            plans.append(RunningRequestPlan(request.request_id, new_blocks, num_new, drafts))
            budget -= num_new
            index += 1
        return plans, budget, preempted

    def _shares(self) -> TenantShares:
        return TenantShares(self.running, self.config.max_num_seqs, self.block_manager.num_blocks)

    def _admit(self, request: Request, prefix: PrefixMatch) -> None:
        self.waiting.remove(request)
        if request.num_preemptions == 0:  # a fork's tokens came from a sibling, not the cache
            request.num_cached_tokens = prefix.num_tokens if prefix.from_cache else 0
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.forget_in_flight()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._freed_since_last_plan.append(request.request_id)
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
