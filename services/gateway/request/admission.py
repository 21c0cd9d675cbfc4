"""Admitting a Generate request: one `GenerateCall` in, one `Admitted` out.

In order: authenticate the tenant, bound this gateway's in-flight requests, check the input,
resolve the sampling parameters (validated here, once for the whole mesh: the scheduler and
the worker decode what the gateway sent and trust it), tokenize, charge the tenant's rate
limits, route (which refuses when every scheduler is past the watermarks), submit. Nothing is
queued anywhere until every check passed.
"""

from __future__ import annotations

import asyncio
import time

from services.gateway.mesh.catalog import ModelCatalog
from services.gateway.mesh.router import Routed, RouteDecision
from services.gateway.mesh.tokenizer_link import TokenizerLink
from services.gateway.mesh.watermarks import TenantAsk
from services.gateway.policy.policy import GatewayPolicy
from services.gateway.policy.rate_limits import Grant
from services.gateway.policy.request_ids import in_use
from services.gateway.request.call_context import time_remaining
from services.gateway.request.generate_call import Checked, GenerateCall
from services.gateway.request.handover import (
    decode_sampling,
    prefill_sampling,
    split_roles,
    splittable,
    worth_splitting,
)
from services.gateway.request.placement import submit
from services.gateway.request.request_record import ActiveRequest, Admitted
from services.gateway.request.request_sampling import (
    for_completion,
    num_completions,
    resolve_sampling,
)
from services.gateway.request.request_telemetry import span_seed
from services.gateway.request.stop_strings import check_stop_strings
from services.gateway.request.tools import constrain_to_calls, tool_use
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import scheduler_pb2
from shared.runtime.service import ServiceRuntime


class Admission:
    def __init__(
        self,
        runtime: ServiceRuntime,
        catalog: ModelCatalog,
        tokenizer: TokenizerLink,
        policy: GatewayPolicy,
    ) -> None:
        self.runtime = runtime
        self.catalog = catalog
        self.tokenizer = tokenizer
        self.policy = policy
        # Open requests by (tenant, request id), a placement per completion: a tenant sees and
        # aborts only its own.
        self.active: dict[tuple[str, str], list[ActiveRequest]] = {}
        self._num_admitting = 0
        self._releases: set[asyncio.Task[None]] = set()

    async def admit(self, call: GenerateCall) -> Admitted:
        """The accepted request, or a KvmeshError saying why not (nothing left queued)."""
        with call.telemetry.phase("admission"):
            checked = self._check(call)
        self._num_admitting += 1
        try:
            if call.request.request_id:  # a generated one is unique already
                claims = self.policy.request_ids
                call.claim = await claims.claim(checked.tenant.name, call.request_id)
            return await self._place(call, checked)
        finally:
            self._num_admitting -= 1

    def _check(self, call: GenerateCall) -> Checked:
        request = call.request
        self.runtime.refuse_if_draining()
        tenant = self.policy.api_keys.authenticate(call.context.invocation_metadata())
        tenant.check_priority(request.priority)
        self.policy.tenant_failures.check(tenant.name)
        self.policy.limits.check_size(request.ByteSize())
        if (tenant.name, call.request_id) in self.active:
            raise in_use(call.request_id)
        if len(self.active) + self._num_admitting >= self.policy.max_in_flight:
            raise KvmeshError(
                Reason.OVERLOADED,
                f"this gateway already holds {self.policy.max_in_flight} requests",
                retryable=True,
                retry_after_ms=1000,
            )
        check_stop_strings(list(request.stop))
        num_completions(request.n)
        candidates = self.catalog.schedulers(request.model)
        model = candidates[0].served_model()
        sampling = resolve_sampling(request.sampling, model.default_sampling, model.vocab_size)
        if sampling.prompt_logprobs is not None and model.backend != "torch":
            raise KvmeshError(  # the cupy backend computes logits for sampled rows only
                Reason.INVALID_SAMPLING_PARAMS,
                f"prompt_logprobs need the torch backend; {model.name} runs on {model.backend}",
            )
        call.tools = tool_use(request)
        sampling = constrain_to_calls(call.tools, sampling)
        self.tokenizer.require()
        return Checked(tenant, candidates, model, sampling)

    async def _place(self, call: GenerateCall, checked: Checked) -> Admitted:
        """Tokenize, charge the tenant's rate limits, route and submit."""
        request, telemetry, model = call.request, call.telemetry, checked.model
        remaining = time_remaining(call.context, request.timeout_ms)
        telemetry.prompt(request.text)
        limits, rate_limiter = self.policy.limits, self.policy.rate_limiter
        with telemetry.phase("tokenize") as span:
            metadata = telemetry.phase_metadata(span)
            prompt_limit = limits.prompt_limit(model)
            try:
                token_ids = await self.tokenizer.prompt_token_ids(
                    request, model, remaining, metadata, prompt_limit
                )
            except KvmeshError as error:
                if error.reason is Reason.PROMPT_TOO_LONG:  # counted to the limit at most
                    await rate_limiter.charge(checked.tenant, prompt_limit)
                raise
            span.set_attribute("gen_ai.usage.input_tokens", len(token_ids))
        sampling = checked.sampling
        try:
            limits.check_tokens(len(token_ids), sampling.max_tokens)
        except KvmeshError:
            await rate_limiter.charge(checked.tenant, len(token_ids))
            raise
        with telemetry.phase("rate_limit"):
            n = num_completions(request.n)
            grant = await rate_limiter.admit(
                checked.tenant, call.request_id, len(token_ids) + n * sampling.max_tokens, n
            )
        try:
            with telemetry.phase("route") as span:
                route, prefill_only = await self._route(call, checked, token_ids)
                span.set_attributes(route.span_attributes())
            if remaining is not None:
                remaining -= time.monotonic() - call.received
            sent = prefill_sampling(sampling) if prefill_only else None
            admitted = await submit(
                call,
                checked,
                Routed(route, checked.tenant),
                token_ids,
                grant,
                remaining,
                prefill_only=prefill_only,
                sent=sent,
            )
        except BaseException:
            self.release(grant, 0)
            raise
        telemetry.admitted(
            {
                "gen_ai.request.model": model.name,
                "gen_ai.response.model": model.name,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.request.seed": span_seed(admitted.sampling_pb.seed),
                "gen_ai.usage.input_tokens": len(token_ids),
                "kvmesh.tenant": checked.tenant.name,
                **route.span_attributes(),
            }
        )
        return admitted

    async def _route(
        self, call: GenerateCall, checked: Checked, token_ids: list[int]
    ) -> tuple[RouteDecision, bool]:
        """Where the request goes, and whether that is a prefill pair (the decode pair it would
        have gone to has enough of the prompt to compute: handed over after the first token)."""
        router, tenant = self.policy.router, checked.tenant
        ask = TenantAsk.of(tenant, len(token_ids), num_completions(call.request.n))
        prefill, decoding = split_roles(checked.candidates)
        route = await router.route(decoding, token_ids, tenant.cache_salt, ask)
        if not prefill or not splittable(call.request, checked.sampling):
            return route, False
        if not worth_splitting(route, self.policy.handover_min_tokens):
            return route, False
        return await router.route(prefill, token_ids, tenant.cache_salt, ask), True

    async def admit_siblings(self, call: GenerateCall, first: Admitted) -> list[Admitted]:
        """Completions 1 to n - 1 of an admitted request, on its scheduler (where they fork
        from its prompt). Nothing stays queued when one is refused: all are cancelled."""
        n = num_completions(call.request.n)
        remaining = time_remaining(call.context, call.request.timeout_ms)
        members = [first]
        try:
            for index in range(1, n):
                sampling = for_completion(first.sampling, index)
                checked = Checked(first.tenant, [first.backend], first.model, sampling)
                routed, tokens = Routed(first.routed.route, first.tenant), first.token_ids
                members.append(
                    await submit(call, checked, routed, tokens, first.grant, remaining, index=index)
                )
        except BaseException:
            for member in members:
                member.submit.cancel()
                member.routed.ended()
            self.release(first.grant, 0)
            raise
        return members

    async def fail_over(self, call: GenerateCall, failed: Admitted, error: KvmeshError) -> Admitted:
        """The request again, same tokens and sampling, on another ready scheduler of the same
        model version, within the request's deadline; KvmeshError when none can take it."""
        failed.attempts[-1].error_reason = error.reason.value
        remaining = _remaining_s(call)
        if remaining is not None and remaining <= 0:
            raise error
        pinned = f"{failed.model.name}@{failed.model.version}"
        try:
            ready = self.catalog.schedulers(pinned, split=False)
        except KvmeshError:
            raise error from None
        others = [backend for backend in ready if backend is not failed.backend]
        if not others:
            raise error
        checked = Checked(failed.tenant, others, failed.model, failed.sampling)
        with call.telemetry.phase("route") as span:
            ask = TenantAsk.of(failed.tenant, len(failed.token_ids))
            route = await self.policy.router.route(
                others, failed.token_ids, failed.tenant.cache_salt, ask
            )
            span.set_attributes(route.span_attributes())
        return await submit(
            call,
            checked,
            Routed(route, failed.tenant),
            failed.token_ids,
            failed.grant,
            remaining,
            failed.attempts,
            failed.index,
        )

    async def hand_over(
        self,
        call: GenerateCall,
        prefilled: Admitted,
        ticket: scheduler_pb2.HandoverTicket,
        first_ids: list[int],
    ) -> Admitted:
        """A prefilled request to a pair that decodes (same model version), with its first
        tokens and the ticket its blocks are pulled with; KvmeshError when none takes it."""
        remaining = _remaining_s(call)
        if remaining is not None and remaining <= 0:
            raise KvmeshError(Reason.DEADLINE_EXCEEDED, "the deadline passed at the handover")
        pinned = f"{prefilled.model.name}@{prefilled.model.version}"
        _, decoding = split_roles(self.catalog.schedulers(pinned, split=False))
        token_ids = prefilled.token_ids + first_ids
        checked = Checked(prefilled.tenant, decoding, prefilled.model, prefilled.sampling)
        with call.telemetry.phase("route") as span:
            tenant = prefilled.tenant
            ask = TenantAsk.of(tenant, len(token_ids))
            route = await self.policy.router.route(decoding, token_ids, tenant.cache_salt, ask)
            span.set_attributes(route.span_attributes())
        moved = await submit(
            call,
            checked,
            Routed(route, prefilled.tenant),
            token_ids,
            prefilled.grant,
            remaining,
            prefilled.attempts,
            prefilled.index,
            ticket=ticket,
            sent=decode_sampling(prefilled.sampling, len(first_ids)),
        )
        if moved.handover is not None:
            moved.handover.prefill_scheduler = prefilled.backend.address
        return moved

    def release(self, grant: Grant | None, tokens_used: int) -> None:
        """Return the tenant's charge in the background: a stream's cleanup never waits on
        Redis, and a cancelled stream still releases."""
        if grant is None:
            return
        task = asyncio.create_task(self.policy.rate_limiter.release(grant, tokens_used))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


def _remaining_s(call: GenerateCall) -> float | None:
    """The client's deadline from now, or the request's own timeout if sooner."""
    remaining = call.context.time_remaining()
    if call.request.timeout_ms:
        left = call.request.timeout_ms / 1e3 - (time.monotonic() - call.received)
        remaining = left if remaining is None else min(remaining, left)
    return remaining
