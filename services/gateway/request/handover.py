"""The gateway's half of the prefill/decode split: which requests go to a prefill pair first,
and what their decode pair is sent once the first token is out.

A request is split when the model has ready prefill pairs and ready decode (or mixed) pairs,
and the decode pair the router would pick has at least `handover_min_tokens` of its prompt to
compute; else it goes straight there (a short prompt costs a decode batch less than a hand-
over). The prefill pair gets it with max_tokens 1 and streams the first token, which the
client sees at once; its `finished` event carries the ticket. The decode pair gets the prompt
and that token, the ticket, and what is left of max_tokens; it pulls the blocks from the
prefill worker before it accepts. Requests whose sampling reads the output so far (n > 1,
response formats, repetition penalties) are not split: the decode pair would take the first
token for prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from services.gateway.mesh.connections import SchedulerBackend
from services.gateway.mesh.router import RouteDecision
from shared.pb.kvmesh.v1 import inference_pb2, scheduler_pb2
from shared.sampling import SamplingParams

PREFILL, DECODE = "prefill", "decode"


def role_of(backend: SchedulerBackend) -> str:
    model = backend.model
    return (model.serving_role if model is not None else "") or "mixed"


def split_roles(
    candidates: Sequence[SchedulerBackend],
) -> tuple[list[SchedulerBackend], list[SchedulerBackend]]:
    """(prefill pairs, pairs that decode). With no pair that decodes ready, prefill pairs
    serve whole requests (a prefill pair is a full scheduler and worker): never refused."""
    prefill = [b for b in candidates if role_of(b) == PREFILL]
    decoding = [b for b in candidates if role_of(b) != PREFILL]
    return (prefill, decoding) if decoding else ([], list(candidates))


def splittable(request: inference_pb2.GenerateRequest, sampling: SamplingParams) -> bool:
    return (
        request.n <= 1
        and sampling.max_tokens > 1
        and sampling.response_format is None
        and sampling.repetition_penalty == 1.0
        and sampling.presence_penalty == 0.0
        and sampling.frequency_penalty == 0.0
    )


def worth_splitting(decode_route: RouteDecision, min_tokens: int) -> bool:
    return decode_route.uncached_tokens >= min_tokens


def prefill_sampling(sampling: SamplingParams) -> SamplingParams:
    return replace(sampling, max_tokens=1)


def decode_sampling(sampling: SamplingParams, emitted: int) -> SamplingParams:
    """The prompt's logprobs came with the prefill pair's token: the decode pair loads the
    prompt's blocks instead of scoring it again."""
    return replace(sampling, max_tokens=sampling.max_tokens - emitted, prompt_logprobs=None)


def handover_record(
    ticket: scheduler_pb2.HandoverTicket, accepted: scheduler_pb2.SubmitAccepted
) -> inference_pb2.Handover:
    """How the decode pair's pull went (the prefill scheduler is the caller's to add)."""
    return inference_pb2.Handover(
        prefill_worker=ticket.worker,
        blocks=accepted.handover_blocks,
        bytes=accepted.handover_bytes,
        seconds=accepted.handover_seconds,
        outcome=accepted.handover_outcome,
    )
