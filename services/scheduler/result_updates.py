"""A step's result into the scheduler's requests: computed counts, tokens, stops, failures.

The Scheduler's `update()`, apart from its planning: a steady decode request takes the short
path here (no drafts, no load, one token), about a microsecond of Python a step; `assume()`,
which counts a step as done before its result comes back (planning one ahead); and how a
request ends (finished, aborted or failed).
"""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.groups import Groups
from services.scheduler.prompt_scores import PromptScores
from services.scheduler.request import Request, RequestStatus
from services.scheduler.speculation import Speculator
from services.scheduler.tier_loads import TierLoads
from shared.outputs import FinishReason, RequestOutput
from shared.step import (
    FailedRequest,
    LoadFailure,
    NewRequestPlan,
    RunningRequestPlan,
    SampledToken,
    StepPlan,
    StepResult,
)


class ResultUpdates:
    """The Scheduler's half that applies results and ends requests; the Scheduler's
    constructor sets these."""

    requests: dict[str, Request]
    running: list[Request]
    waiting: list[Request]
    leases: dict[str, Request]
    block_manager: BlockManager
    tier_loads: TierLoads
    speculator: Speculator
    groups: Groups
    prompt_scores: PromptScores
    num_finished: int
    _freed_since_last_plan: list[str]

    def assume(self, plan: StepPlan) -> None:
        """Plan one step ahead: count `plan` as computed before its result comes back, so the
        next schedule() plans from it (a decode's next input is the token the worker samples,
        which the worker appends itself). update() then settles it. No drafts: a proposal
        needs the tokens it follows."""
        for new in plan.new_requests:
            self.requests[new.request_id].assume(new.num_scheduled_tokens)
        for running in plan.running_requests:
            if running.draft_token_ids:
                raise ValueError("a plan with drafts cannot be planned ahead of")
            self.requests[running.request_id].assume(running.num_scheduled_tokens)

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Advance counters by what the plan computed, append sampled tokens, finish requests."""
        # Failures first: a failed request's blocks must not be cached as computed below.
        outputs = [self._fail(f) for f in result.failed if f.request_id in self.requests]
        if result.prompt_logprobs:
            self.prompt_scores.add(result.prompt_logprobs, self.requests)
        sampled = {s.request_id: s for s in result.sampled}
        short_loads = {f.request_id: f for f in result.load_failures}
        requests, running = self.requests, RequestStatus.RUNNING
        for new in plan.new_requests:
            request = requests.get(new.request_id)
            if request is not None and request.status is running:
                if request.in_flight:
                    request.unassume()
                self._advance(new, request, sampled, short_loads, outputs)
        manager = self.block_manager
        block_size = manager.block_size
        for planned in plan.running_requests:
            request = requests.get(planned.request_id)
            if request is None or request.status is not running:
                continue  # aborted or preempted while the step ran
            if request.in_flight:  # planned ahead: settled as if it had not been
                request.unassume()
            token = sampled.get(planned.request_id)
            if token is None or planned.draft_token_ids or request.loading:
                self._advance(planned, request, sampled, short_loads, outputs)
                continue
            # The common case, as _advance does it: computed what was planned, one new token.
            request.num_computed_tokens += planned.num_scheduled_tokens
            request.token_ids.append(token.token_id)
            reason = request.stop_reason(token.token_id)
            if request.num_confirmed_tokens // block_size > request.num_hashed_blocks:
                manager.cache_full_blocks(request)  # a block filled
            logprobs = () if token.logprobs is None else (token.logprobs,)
            outputs.append(
                RequestOutput(request.request_id, (token.token_id,), logprobs)
                if reason is None
                else self._finish(request, reason, (token.token_id,), logprobs)
            )
        self.prompt_scores.attach(outputs)
        return outputs

    def _advance(
        self,
        planned: NewRequestPlan | RunningRequestPlan,
        request: Request,
        sampled: dict[str, SampledToken],
        short_loads: dict[str, LoadFailure],
        outputs: list[RequestOutput],
    ) -> None:
        """What one planned request computed: a load that fell short, drafts, a token."""
        request_id, drafts = planned.request_id, planned.draft_token_ids
        if self.tier_loads.fell_short(request, short_loads.get(request_id), self.block_manager):
            if failed := self.tier_loads.handover_failure(request):
                outputs.append(self._fail(failed))
            return  # it computed nothing: on from what did load
        token = sampled.get(request_id)
        # Computed: the tokens before the drafts, and the drafts the worker accepted.
        accepted = token.num_accepted_drafts if token and drafts else 0
        request.num_computed_tokens += planned.num_scheduled_tokens - len(drafts) + accepted
        if token is None:
            self.block_manager.cache_full_blocks(request)
            return
        logprobs = () if token.logprobs is None else (*token.draft_logprobs, token.logprobs)
        tokens = (*drafts[:accepted], token.token_id)
        emitted, logprobs, reason = request.append_output(tokens, logprobs)
        # A stop among the drafts ends it there: the K/V past the stop is not its own.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        self.block_manager.cache_full_blocks(request)
        if drafts:  # the slots of rejected drafts go back
            self.speculator.settle(request, len(drafts), accepted)
        outputs.append(
            RequestOutput(request_id, emitted, logprobs)
            if reason is None
            else self._finish(request, reason, emitted, logprobs)
        )

    def _fail(self, failure: FailedRequest) -> RequestOutput:
        """It ends now, none of its blocks cached (what a failed pass wrote may be garbage)."""
        request = self.requests[failure.request_id]
        self._end(request, drop_cached=True)
        return RequestOutput(
            request.request_id, (), num_cached_tokens=request.num_cached_tokens, failure=failure
        )

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        new_token_ids: tuple[int, ...],
        logprobs: tuple = (),
    ) -> RequestOutput:
        held = request.prefill_only and reason == FinishReason.FINISH_REASON_LENGTH
        scores = self.prompt_scores.take(request.request_id)
        self._end(request, hold=held)
        request.finish_reason = reason
        output = request.final_output(new_token_ids, logprobs)
        output.prompt_logprobs = scores
        return output

    def _end(self, request: Request, drop_cached: bool = False, hold: bool = False) -> None:
        """Out of its queue and the pool (unless held: a lease); then the worker forgets it."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if hold:
            self.leases[request.request_id] = request
        else:
            self.block_manager.free(request, drop_cached)
            self._freed_since_last_plan.append(request.request_id)
        self.groups.remove(request)
        self.speculator.forget(request)
        self.prompt_scores.forget(request.request_id)
        request.forget_in_flight()
        self.num_finished += 1
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
