"""What the gateway knows of an accepted request, and the Completed event built from it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from services.gateway.mesh.connections import SchedulerBackend
from services.gateway.mesh.router import Routed
from services.gateway.mesh.submit_lanes import LaneCall
from services.gateway.policy.rate_limits import Grant
from shared import grpc_errors
from shared.errors import KvmeshError, Reason
from shared.outputs import FinishReason, finish_reason_label
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, scheduler_pb2
from shared.sampling import SamplingParams
from shared.tenants import Tenant


@dataclass
class ActiveRequest:
    backend: SchedulerBackend
    upstream_id: str  # its id at the scheduler and worker


def upstream_request_id(
    request_id: str, tenant: Tenant, client_named: bool, attempt: int = 1, member: str = ""
) -> str:
    """A client's own request id is scoped by its tenant upstream: two tenants may pick the
    same id without either learning of the other (generated ids are unique already). A second
    attempt carries its number, so scheduler and worker logs tell the attempts apart; each of
    n > 1 completions its index (`member`)."""
    scoped = f"{tenant.name}/{request_id}" if client_named else request_id
    return f"{scoped}{member}" if attempt == 1 else f"{scoped}{member}#{attempt}"


def member_suffix(index: int, n: int) -> str:
    """How one of n completions is told apart in ids: `[2]`; nothing when n is 1."""
    return f"[{index}]" if n > 1 else ""


def attempt_id(request_id: str, attempt: int, member: str = "") -> str:
    return f"{request_id}{member}#{attempt}"


@dataclass
class Admitted:
    """A request the scheduler accepted: where it runs, for whom and with what."""

    routed: Routed
    tenant: Tenant
    grant: Grant | None  # the rate-limit charge, released when the request ends
    sampling: SamplingParams  # validated, the model's defaults merged, the seed chosen
    sampling_pb: common_pb2.SamplingParams  # the same, encoded once: sent up and recorded
    token_ids: list[int]
    submit: LaneCall  # the scheduler's events for it; cancelling aborts
    queue_position: int
    upstream_id: str  # the request's id at the scheduler (tenant-scoped when client-named)
    # The model version it runs on, kept: its scheduler may drain (and forget it) meanwhile.
    model: common_pb2.ModelInfo
    # Every placement so far, this one last (its error_reason empty while it runs).
    attempts: list[inference_pb2.Attempt]
    stop: list[str]  # the stop strings the gateway matches
    index: int = 0  # which of the request's n completions
    prefill_only: bool = False  # on a prefill pair: handed over to a decode pair after it
    handover: inference_pb2.Handover | None = None  # on a decode pair: where its prompt ran

    @property
    def backend(self) -> SchedulerBackend:
        return self.routed.route.backend


@dataclass
class Progress:
    prompt_tokens: int
    received: float
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    # The scheduler's queue and prefill times, from its first tokens event.
    first_timings: scheduler_pb2.FirstTokenTimings | None = None

    def usage(self) -> inference_pb2.Usage:
        return inference_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )


def accepted_event(
    request_id: str, admitted: Admitted, trace_id: str
) -> inference_pb2.GenerateEvent:
    return inference_pb2.GenerateEvent(
        accepted=inference_pb2.Accepted(
            request_id=request_id,
            queue_position=admitted.queue_position,
            prompt_tokens=len(admitted.token_ids),
            model=admitted.model.name,
            model_version=admitted.model.version,
            routing=admitted.routed.route.to_pb(),
            trace_id=trace_id,
        )
    )


def completed_event(
    reason: FinishReason,
    stop_string: str,
    finished: scheduler_pb2.SubmitFinished | None,
    progress: Progress,
    admitted: Admitted,
) -> inference_pb2.GenerateEvent:
    now = time.monotonic()
    backend, sampling, model = admitted.backend, admitted.sampling_pb, admitted.model
    timings = inference_pb2.Timings(
        total_ms=(now - progress.received) * 1e3,
        ttft_ms=((progress.first_token_at or now) - progress.received) * 1e3,
    )
    if finished is not None:
        timings.queue_ms = finished.queue_ms
        timings.prefill_ms = finished.prefill_ms
        timings.decode_ms = finished.decode_ms
        timings.draft_tokens = finished.draft_tokens
        timings.accepted_draft_tokens = finished.accepted_draft_tokens
        timings.loaded_tokens = finished.loaded_tokens
    elif progress.first_timings is not None:  # a stop string: the gateway ended it
        timings.queue_ms = progress.first_timings.queue_ms
        timings.prefill_ms = progress.first_timings.prefill_ms
        timings.loaded_tokens = progress.first_timings.loaded_tokens
        timings.decode_ms = (now - (progress.first_token_at or now)) * 1e3
    return inference_pb2.GenerateEvent(
        completed=inference_pb2.Completed(
            finish_reason=reason,
            stop_string=stop_string,
            usage=progress.usage(),
            timings=timings,
            execution=inference_pb2.ExecutionRecord(
                model_name=model.name,
                model_version=model.version,
                artifact_digest=model.artifact_digest,
                backend=model.backend,
                dtype=model.dtype,
                sampling=sampling,
                seed=sampling.seed,
                scheduler=backend.address,
                routing=admitted.routed.route.to_pb(),
                tenant=admitted.tenant.name,
                attempts=admitted.attempts,
                runtime=model.runtime,
                device=model.device,
                threads=model.threads,
                tokenizer_digest=model.tokenizer_digest,
                stop=admitted.stop,
                prepared_id=model.prepared_id,
                worker=finished.worker if finished is not None else "",
                handover=admitted.handover,
            ),
        )
    )


def terminal_reason(event: inference_pb2.GenerateEvent) -> str:
    """The reason label of a terminal event: finish reason, cancel reason or error reason."""
    kind = event.WhichOneof("event")
    if kind == "completed":
        return finish_reason_label(event.completed.finish_reason)
    if kind == "cancelled":
        return event.cancelled.reason or "abort"
    return event.failed.error.reason or "internal"


log = logging.getLogger("kvmesh.gateway")
LOST_PEER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)


def upstream_failure(error: grpc.RpcError | KvmeshError, emitted: bool) -> KvmeshError:
    """A stream that broke after acceptance. A status without a kvmesh reason that reads
    UNAVAILABLE, CANCELLED or INTERNAL (grpcio's "Internal error from Core" when the peer
    vanished mid-call) is a peer that died: WORKER_LOST. A reason the upstream reported itself,
    INTERNAL included, is passed on as it is. A lost peer's failure is retryable only while
    the client has seen no token: a resent request would repeat them."""
    if isinstance(error, KvmeshError):
        failure = error
    else:
        failure = grpc_errors.from_rpc_error(error)
        if error.code() in LOST_PEER_CODES and grpc_errors.rich_status_of(error) is None:
            # gRPC's detail names addresses: the log has it, the client a plain sentence.
            log.warning("upstream lost", extra={"detail": failure.message})
            failure = KvmeshError(
                Reason.WORKER_LOST,
                "a service on the request's path stopped responding",
                retryable=True,
                retry_after_ms=1000,
            )
    if emitted and failure.reason in (Reason.WORKER_LOST, Reason.TOKENIZER_LOST):
        failure.retryable, failure.retry_after_ms = False, 0
    return failure
