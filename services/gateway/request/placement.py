"""Placing an admitted request on a scheduler: one upstream lane, waited on until accepted.

Every placement goes through here: the first, a fail-over's, an n > 1 request's siblings, and
the two halves of a request split between a prefill and a decode pair.
"""

from __future__ import annotations

import grpc

from services.gateway.mesh.router import Routed
from services.gateway.policy.rate_limits import Grant
from services.gateway.request.generate_call import Checked, GenerateCall
from services.gateway.request.handover import handover_record
from services.gateway.request.request_record import (
    Admitted,
    attempt_id,
    member_suffix,
    upstream_request_id,
)
from services.gateway.request.request_sampling import num_completions
from shared import grpc_errors
from shared.codec import sampling_to_pb
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import inference_pb2, scheduler_pb2
from shared.sampling import SamplingParams


async def submit(
    call: GenerateCall,
    checked: Checked,
    routed: Routed,
    token_ids: list[int],
    grant: Grant | None,
    remaining: float | None,
    attempts: list[inference_pb2.Attempt] | None = None,
    index: int = 0,
    prefill_only: bool = False,
    ticket: scheduler_pb2.HandoverTicket | None = None,
    sent: SamplingParams | None = None,
) -> Admitted:
    """Sends the request (its completion `index`) to its scheduler and waits for the
    scheduler to accept it. `sent` is what the scheduler is asked to sample when it is not
    the request's own sampling (recorded): the prefill or decode part of a split request."""
    backend = routed.route.backend
    attempts = attempts or []
    attempt = len(attempts) + 1
    n = num_completions(call.request.n)
    member = member_suffix(index, n)
    client_named = bool(call.request.request_id)
    upstream_id = upstream_request_id(
        call.request_id, checked.tenant, client_named, attempt, member
    )
    # The n completions share the prompt's blocks where they run on one scheduler.
    group = upstream_request_id(call.request_id, checked.tenant, client_named) if n > 1 else ""
    sampling = checked.sampling  # this completion's own (its seed)
    sampling_pb = sampling_to_pb(sampling)  # encoded once: sent here, recorded at the end
    upstream = backend.lanes.submit(
        scheduler_pb2.SubmitRequest(
            request_id=upstream_id,
            token_ids=token_ids,
            sampling=sampling_pb if sent is None else sampling_to_pb(sent),
            priority=call.request.priority,
            cache_salt=checked.tenant.cache_salt,
            tenant=checked.tenant.name,
            tenant_weight=checked.tenant.weight,
            group_id=group,
            prefill_only=prefill_only,
            handover=ticket,
        ),
        timeout=remaining,
        metadata=call.telemetry.metadata(),
    )
    try:
        first = await upstream.read()
        if first is not grpc.aio.EOF and first.WhichOneof("event") == "failed":
            raise grpc_errors.from_pb(first.failed)  # refused: overloaded, draining, ...
        if first is grpc.aio.EOF or first.WhichOneof("event") != "accepted":
            raise KvmeshError(Reason.INTERNAL, "the scheduler did not accept the request")
    except grpc.RpcError as error:
        routed.ended()
        raise grpc_errors.from_rpc_error(error) from None
    except BaseException:
        upstream.cancel()  # the client left before acceptance: do not leave it queued
        routed.ended()
        raise
    routed.accepted()
    admitted = Admitted(
        routed,
        checked.tenant,
        grant,
        sampling,
        sampling_pb,
        token_ids,
        upstream,
        first.accepted.queue_position,
        upstream_id,
        backend.model or checked.model,
        [
            *attempts,
            inference_pb2.Attempt(
                attempt_id=attempt_id(call.request_id, attempt, member),
                scheduler=backend.address,
            ),
        ],
        list(call.request.stop),
        index,
        prefill_only,
    )
    if ticket is not None:
        admitted.handover = handover_record(ticket, first.accepted)
    return admitted
