"""Admitting a Generate request: one `GenerateCall` in, one `Admitted` out.

In order: authenticate the tenant, bound this gateway's in-flight requests, check the input,
resolve the sampling parameters (validated here, once for the whole mesh: the scheduler and
the worker decode what the gateway sent and trust it), tokenize, charge the tenant's rate
limits, route (which refuses when every scheduler is past the watermarks), submit. Nothing is
queued anywhere until every check passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass

import grpc

from services.gateway.call_context import CallContext
from services.gateway.catalog import ModelCatalog
from services.gateway.connections import SchedulerBackend
from services.gateway.policy import GatewayPolicy
from services.gateway.rate_limits import Grant
from services.gateway.request_record import (
    ActiveRequest,
    Admitted,
    attempt_id,
    upstream_request_id,
)
from services.gateway.request_telemetry import RequestTelemetry
from services.gateway.router import Routed
from services.gateway.stop_strings import check_stop_strings
from services.gateway.tenants import Tenant
from services.gateway.tokenizer_link import TokenizerLink
from shared import grpc_errors
from shared.codec import sampling_from_pb, sampling_to_pb
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, scheduler_pb2
from shared.sampling import SamplingParams
from shared.service import ServiceRuntime


def resolve_sampling(
    message: common_pb2.SamplingParams, model_defaults: common_pb2.SamplingParams | None = None
) -> SamplingParams:
    """The parameters in force: fields the request leaves unset take the model's defaults (its
    repository entry, checked when the model loaded), then the engine's; validated; a seed
    chosen when none was given, so the execution record can say exactly what ran."""
    if model_defaults is not None and model_defaults.ListFields():
        merged = common_pb2.SamplingParams()
        merged.CopyFrom(model_defaults)
        merged.MergeFrom(message)
        message = merged
    params = sampling_from_pb(message).validate()
    if params.seed is None:
        params = dataclasses.replace(params, seed=random.getrandbits(63))
    return params


def time_remaining(context: CallContext, timeout_ms: int) -> float | None:
    """Seconds left: the sooner of the client's gRPC deadline and the request's timeout_ms."""
    remaining = context.time_remaining()
    if timeout_ms:
        remaining = timeout_ms / 1e3 if remaining is None else min(remaining, timeout_ms / 1e3)
    return remaining


@dataclass
class GenerateCall:
    """One Generate call, as every step of its admission reads it."""

    request: inference_pb2.GenerateRequest
    context: CallContext
    request_id: str  # the client's, or one made up for it
    received: float  # time.monotonic() at arrival
    telemetry: RequestTelemetry


@dataclass(frozen=True)
class Checked:
    """A request that passed every check needing no other service."""

    tenant: Tenant
    candidates: list[SchedulerBackend]  # ready schedulers of the model version chosen
    model: common_pb2.ModelInfo
    sampling: SamplingParams


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
        # Open requests by (tenant, request id): a tenant sees and aborts only its own.
        self.active: dict[tuple[str, str], ActiveRequest] = {}
        self._num_admitting = 0
        self._releases: set[asyncio.Task[None]] = set()

    async def admit(self, call: GenerateCall) -> Admitted:
        """The accepted request, or a KvmeshError saying why not (nothing left queued)."""
        with call.telemetry.phase("admission"):
            checked = self._check(call)
        self._num_admitting += 1
        try:
            return await self._place(call, checked)
        finally:
            self._num_admitting -= 1

    def _check(self, call: GenerateCall) -> Checked:
        request = call.request
        self.runtime.refuse_if_draining()
        tenant = self.policy.api_keys.authenticate(call.context.invocation_metadata())
        tenant.check_priority(request.priority)
        self.policy.limits.check_size(request.ByteSize())
        if (tenant.name, call.request_id) in self.active:
            raise KvmeshError(Reason.INVALID_ARGUMENT, f"request id {call.request_id!r} is in use")
        if len(self.active) + self._num_admitting >= self.policy.max_in_flight:
            raise KvmeshError(
                Reason.OVERLOADED,
                f"this gateway already holds {self.policy.max_in_flight} requests",
                retryable=True,
                retry_after_ms=1000,
            )
        check_stop_strings(list(request.stop))
        candidates = self.catalog.schedulers(request.model)
        model = candidates[0].model
        assert model is not None
        sampling = resolve_sampling(request.sampling, model.default_sampling)
        self.tokenizer.require()
        return Checked(tenant, candidates, model, sampling)

    async def _place(self, call: GenerateCall, checked: Checked) -> Admitted:
        """Tokenize, charge the tenant's rate limits, route and submit."""
        request, telemetry, model = call.request, call.telemetry, checked.model
        remaining = time_remaining(call.context, request.timeout_ms)
        telemetry.prompt(request.text)
        with telemetry.phase("tokenize") as span:
            metadata = telemetry.phase_metadata(span)
            token_ids = await self.tokenizer.prompt_token_ids(request, model, remaining, metadata)
            span.set_attribute("gen_ai.usage.input_tokens", len(token_ids))
        sampling = checked.sampling
        self.policy.limits.check_tokens(len(token_ids), sampling.max_tokens)
        with telemetry.phase("rate_limit"):
            grant = await self.policy.rate_limiter.admit(
                checked.tenant, call.request_id, len(token_ids) + sampling.max_tokens
            )
        try:
            with telemetry.phase("route") as span:
                route = await self.policy.router.route(
                    checked.candidates, token_ids, checked.tenant.cache_salt
                )
                span.set_attributes(route.span_attributes())
            if remaining is not None:
                remaining -= time.monotonic() - call.received
            admitted = await self._submit(call, checked, Routed(route), token_ids, grant, remaining)
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
                "gen_ai.request.seed": admitted.sampling_pb.seed,
                "gen_ai.usage.input_tokens": len(token_ids),
                "kvmesh.tenant": checked.tenant.name,
                **route.span_attributes(),
            }
        )
        return admitted

    async def _submit(
        self,
        call: GenerateCall,
        checked: Checked,
        routed: Routed,
        token_ids: list[int],
        grant: Grant | None,
        remaining: float | None,
        attempts: list[inference_pb2.Attempt] | None = None,
    ) -> Admitted:
        """Sends the request to its scheduler and waits for the scheduler to accept it."""
        backend = routed.route.backend
        attempts = attempts or []
        attempt = len(attempts) + 1
        upstream_id = upstream_request_id(
            call.request_id, checked.tenant, bool(call.request.request_id), attempt
        )
        sampling_pb = sampling_to_pb(checked.sampling)  # once: sent here, recorded at the end
        submit = backend.stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id=upstream_id,
                token_ids=token_ids,
                sampling=sampling_pb,
                priority=call.request.priority,
                cache_salt=checked.tenant.cache_salt,
                tenant=checked.tenant.name,
                tenant_weight=checked.tenant.weight,
            ),
            timeout=remaining,
            metadata=call.telemetry.metadata(),
        )
        try:
            first = await submit.read()
            if first is grpc.aio.EOF or first.WhichOneof("event") != "accepted":
                raise KvmeshError(Reason.INTERNAL, "the scheduler did not accept the request")
        except grpc.RpcError as error:
            routed.ended()
            raise grpc_errors.from_rpc_error(error) from None
        except BaseException:
            submit.cancel()  # the client left before acceptance: do not leave it queued
            routed.ended()
            raise
        routed.accepted()
        return Admitted(
            routed,
            checked.tenant,
            grant,
            checked.sampling,
            sampling_pb,
            token_ids,
            submit,
            first.accepted.queue_position,
            upstream_id,
            backend.model or checked.model,
            [
                *attempts,
                inference_pb2.Attempt(
                    attempt_id=attempt_id(call.request_id, attempt), scheduler=backend.address
                ),
            ],
            list(call.request.stop),
        )

    async def fail_over(self, call: GenerateCall, failed: Admitted, error: KvmeshError) -> Admitted:
        """The request again, same tokens and sampling, on another ready scheduler of the same
        model version, within the request's deadline; KvmeshError when none can take it."""
        failed.attempts[-1].error_reason = error.reason.value
        remaining = call.context.time_remaining()  # the client's deadline, as of now
        if call.request.timeout_ms:
            left = call.request.timeout_ms / 1e3 - (time.monotonic() - call.received)
            remaining = left if remaining is None else min(remaining, left)
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
            route = await self.policy.router.route(
                others, failed.token_ids, failed.tenant.cache_salt
            )
            span.set_attributes(route.span_attributes())
        return await self._submit(
            call,
            checked,
            Routed(route),
            failed.token_ids,
            failed.grant,
            remaining,
            failed.attempts,
        )

    def release(self, grant: Grant | None, tokens_used: int) -> None:
        """Return the tenant's charge in the background: a stream's cleanup never waits on
        Redis, and a cancelled stream still releases."""
        if grant is None:
            return
        task = asyncio.create_task(self.policy.rate_limiter.release(grant, tokens_used))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
