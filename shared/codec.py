"""Dataclass <-> protobuf conversions, in one place for every boundary.

Sampling parameters cross gateway -> scheduler -> worker; step plans and results cross
scheduler <-> worker. The wire messages mirror the dataclasses field for field, but for a
step's running requests and sampled tokens, which travel column by column (one message a step,
not one a request).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, engine_worker_pb2
from shared.sampling import ResponseFormat, SamplingParams
from shared.step import (
    BlockWrite,
    FailedRequest,
    LoadFailure,
    NewRequestPlan,
    PromptLogprobs,
    RunningRequestPlan,
    SampledToken,
    StepPlan,
    StepResult,
    TokenLogprobs,
)


def sampling_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the dataclass defaults. No range is checked here: the
    gateway validated what it sent (`SamplingParams.validate`), and the rest of the mesh
    trusts it."""
    defaults = SamplingParams()
    has = message.HasField
    return SamplingParams(
        max_tokens=message.max_tokens if has("max_tokens") else defaults.max_tokens,
        temperature=message.temperature if has("temperature") else defaults.temperature,
        top_k=message.top_k if has("top_k") and message.top_k > 0 else None,
        top_p=message.top_p if has("top_p") else defaults.top_p,
        min_p=message.min_p,
        repetition_penalty=(
            message.repetition_penalty if has("repetition_penalty") else defaults.repetition_penalty
        ),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if has("seed") else None,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if has("logprobs") else None,
        response_format=response_format_from_pb(message.response_format)
        if has("response_format")
        else None,
        logit_bias=tuple(message.logit_bias.items()),
        disable_speculation=message.disable_speculation,
        prompt_logprobs=message.prompt_logprobs if has("prompt_logprobs") else None,
    )


def default_sampling_to_pb(table: Mapping[str, Any]) -> common_pb2.SamplingParams:
    """A model's default sampling (its entry's [sampling] table) as the wire message; an
    unknown field or a wrong type is INVALID_SAMPLING_PARAMS. Ranges are the entry's to check
    (`check_default_sampling`), once, when it is read."""
    try:
        return json_format.ParseDict(dict(table), common_pb2.SamplingParams())
    except json_format.ParseError as error:
        raise KvmeshError(Reason.INVALID_SAMPLING_PARAMS, str(error)) from None


def response_format_from_pb(message: common_pb2.ResponseFormat) -> ResponseFormat:
    return ResponseFormat(message.kind, message.spec)


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set, so the receiver needs no defaults of its own."""
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k or 0,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        disable_speculation=params.disable_speculation,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    if params.response_format is not None:
        message.response_format.kind = params.response_format.kind
        message.response_format.spec = params.response_format.spec
    message.logit_bias.update(params.logit_bias)
    return message


def logprobs_to_pb(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def logprobs_from_pb(message: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        message.token_id, message.logprob, tuple((t.token_id, t.logprob) for t in message.top)
    )


def plan_to_pb(plan: StepPlan) -> engine_worker_pb2.StepPlan:
    return engine_worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            engine_worker_pb2.NewRequestPlan(
                request_id=r.request_id,
                token_ids=r.token_ids,
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                sampling=sampling_to_pb(r.sampling),
                prompt_len=r.prompt_len,
                load_hashes=r.load_hashes,
            )
            for r in plan.new_requests
        ],
        running=running_to_pb(plan.running_requests),
        finished_request_ids=plan.finished_request_ids,
        block_copies=[
            engine_worker_pb2.BlockCopy(source=source, destination=destination)
            for source, destination in plan.block_copies
        ],
        block_writes=[
            engine_worker_pb2.BlockWrite(
                block_id=w.block_id, block_hash=w.block_hash, token_ids=w.token_ids
            )
            for w in plan.block_writes
        ],
    )


def plan_from_pb(message: engine_worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        message.step_id,
        tuple(
            NewRequestPlan(
                r.request_id,
                tuple(r.token_ids),
                tuple(r.block_ids),
                r.num_computed_tokens,
                r.num_scheduled_tokens,
                sampling_from_pb(r.sampling),
                r.prompt_len,
                tuple(r.load_hashes),
            )
            for r in message.new_requests
        ),
        running_from_pb(message.running),
        tuple(message.finished_request_ids),
        tuple((c.source, c.destination) for c in message.block_copies),
        tuple(
            BlockWrite(w.block_id, w.block_hash, tuple(w.token_ids)) for w in message.block_writes
        ),
    )


def result_to_pb(result: StepResult, compute_ms: float = 0.0) -> engine_worker_pb2.StepResult:
    failed = [
        engine_worker_pb2.FailedRequest(
            request_id=f.request_id, reason=f.reason, error_type=f.error_type
        )
        for f in result.failed
    ]
    load_failures = [
        engine_worker_pb2.LoadFailure(
            request_id=f.request_id, num_computed_tokens=f.num_computed_tokens, reason=f.reason
        )
        for f in result.load_failures
    ]
    return engine_worker_pb2.StepResult(
        step_id=result.step_id,
        sampled=sampled_to_pb(result.sampled),
        compute_ms=compute_ms,
        failed=failed,
        load_failures=load_failures,
        prompt_logprobs=[
            engine_worker_pb2.PromptLogprobs(
                request_id=p.request_id,
                first_position=p.first_position,
                logprobs=[logprobs_to_pb(lp) for lp in p.logprobs],
            )
            for p in result.prompt_logprobs
        ],
    )


def result_from_pb(message: engine_worker_pb2.StepResult) -> StepResult:
    return StepResult(
        message.step_id,
        sampled_from_pb(message.sampled),
        tuple(FailedRequest(f.request_id, f.reason, f.error_type) for f in message.failed),
        tuple(
            LoadFailure(f.request_id, f.num_computed_tokens, f.reason)
            for f in message.load_failures
        ),
        tuple(
            PromptLogprobs(
                p.request_id, p.first_position, tuple(logprobs_from_pb(lp) for lp in p.logprobs)
            )
            for p in message.prompt_logprobs
        ),
    )


# The per-request parts of a step, as columns (RunningColumns, SampledColumns): a column of
# counts, then the concatenated values. A column every entry leaves empty (no drafts this step)
# is not sent at all.


def running_to_pb(running: Sequence[RunningRequestPlan]) -> engine_worker_pb2.RunningColumns:
    message = engine_worker_pb2.RunningColumns(
        request_ids=[r.request_id for r in running],
        num_scheduled_tokens=[r.num_scheduled_tokens for r in running],
    )
    _put_ragged(message.new_block_counts, message.new_block_ids, [r.new_block_ids for r in running])
    _put_ragged(message.draft_counts, message.draft_token_ids, [r.draft_token_ids for r in running])
    return message


def running_from_pb(message: engine_worker_pb2.RunningColumns) -> tuple[RunningRequestPlan, ...]:
    count = len(message.request_ids)
    new_blocks = _ragged(message.new_block_counts, message.new_block_ids, count)
    drafts = _ragged(message.draft_counts, message.draft_token_ids, count)
    return tuple(
        map(
            RunningRequestPlan,
            message.request_ids,
            new_blocks,
            message.num_scheduled_tokens,
            drafts,
        )
    )


def sampled_to_pb(sampled: Sequence[SampledToken]) -> engine_worker_pb2.SampledColumns:
    message = engine_worker_pb2.SampledColumns(
        request_ids=[s.request_id for s in sampled], token_ids=[s.token_id for s in sampled]
    )
    if any(s.num_accepted_drafts for s in sampled):
        message.num_accepted_drafts.extend([s.num_accepted_drafts for s in sampled])
    for row, token in enumerate(sampled):
        if token.logprobs is None:
            continue
        message.logprob_rows.append(row)
        message.logprobs.append(logprobs_to_pb(token.logprobs))
        message.draft_logprobs.add(logprobs=[logprobs_to_pb(lp) for lp in token.draft_logprobs])
    return message


def sampled_from_pb(message: engine_worker_pb2.SampledColumns) -> tuple[SampledToken, ...]:
    sampled = tuple(map(SampledToken, message.request_ids, message.token_ids))
    for token, accepted in zip(sampled, message.num_accepted_drafts, strict=False):
        token.num_accepted_drafts = accepted
    for row, logprobs, drafts in zip(
        message.logprob_rows, message.logprobs, message.draft_logprobs, strict=True
    ):
        sampled[row].logprobs = logprobs_from_pb(logprobs)
        sampled[row].draft_logprobs = tuple(logprobs_from_pb(lp) for lp in drafts.logprobs)
    return sampled


def _put_ragged(counts: Any, values: Any, rows: Sequence[Sequence[int]]) -> None:
    """Rows of varying length as counts + values; nothing at all when every row is empty."""
    if not any(rows):
        return
    counts.extend([len(row) for row in rows])
    values.extend([value for row in rows for value in row])


def _ragged(counts: Sequence[int], values: Sequence[int], num_rows: int) -> list[tuple[int, ...]]:
    if not counts:
        return [()] * num_rows
    rows, start = [], 0
    for count in counts:
        rows.append(tuple(values[start : start + count]) if count else ())
        start += count
    return rows
