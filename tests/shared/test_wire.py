"""Dataclass <-> proto conversions and the rich error model round-trip without loss."""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest
from google.rpc import error_details_pb2

from shared import grpc_errors
from shared.codec import (
    plan_from_pb,
    plan_to_pb,
    result_from_pb,
    result_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2
from shared.sampling import SamplingParams
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

SAMPLING = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    seed=2**62,
    stop_token_ids=(3, 4),
    ignore_eos=True,
    logprobs=2,
    disable_speculation=True,
    prompt_logprobs=1,
)


def test_sampling_round_trips_and_unset_fields_take_the_defaults() -> None:
    assert sampling_from_pb(sampling_to_pb(SAMPLING)) == SAMPLING
    assert sampling_from_pb(common_pb2.SamplingParams()) == SamplingParams()
    greedy = sampling_from_pb(common_pb2.SamplingParams(temperature=0.0))
    assert greedy.greedy  # an explicit 0 is greedy, unlike an unset field


def test_invalid_sampling_is_refused_by_validate_not_by_decoding() -> None:
    decoded = sampling_from_pb(common_pb2.SamplingParams(top_p=0.0))  # decoding trusts the sender
    with pytest.raises(KvmeshError) as refused:
        decoded.validate()
    assert refused.value.reason is Reason.INVALID_SAMPLING_PARAMS
    bad_format = sampling_from_pb(
        common_pb2.SamplingParams(response_format=common_pb2.ResponseFormat(kind="yaml"))
    )
    with pytest.raises(KvmeshError) as refused:
        bad_format.validate()
    assert refused.value.reason is Reason.INVALID_SCHEMA


def test_step_plan_and_result_round_trip() -> None:
    plan = StepPlan(
        9,
        (NewRequestPlan("a", (1, 2, 3), (0, 5), 0, 3, SAMPLING, 3),),
        (RunningRequestPlan("b", (7,), 1), RunningRequestPlan("c", (), 4, (8, 9, 10))),
        ("d", "e"),
    )
    assert plan_from_pb(plan_to_pb(plan)) == plan
    result = StepResult(
        9,
        (
            SampledToken("a", 11),
            SampledToken("b", 12, TokenLogprobs(12, -0.5, ((12, -0.5),))),
            SampledToken(  # a speculating request: two drafts accepted before the token
                "c", 5, TokenLogprobs(5, -1.0, ()), 2, (TokenLogprobs(8, -0.25, ()),) * 2
            ),
        ),
    )
    assert result_from_pb(result_to_pb(result, 3.0)) == result


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_maps_to_a_status_and_back(reason: Reason) -> None:
    error = KvmeshError(reason, "why", retryable=True, retry_after_ms=250)
    status = grpc_errors.to_rpc_status(error)
    assert status.code == grpc_errors.STATUS_CODES[reason].value[0]
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.reason == reason.value
    rpc_error = grpc.aio.AioRpcError(
        grpc_errors.STATUS_CODES[reason],
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*grpc_errors.trailing_metadata(error)),
        "why",
    )
    back = grpc_errors.from_rpc_error(rpc_error)
    assert (back.reason, back.retryable, back.retry_after_ms) == (reason, True, 250)
    assert grpc_errors.from_pb(grpc_errors.to_pb(error)).reason is reason


def _non_default_everywhere(value: object) -> None:
    """Every field of every step dataclass inside `value` differs from its default, so a
    field the codec forgot would come back as the default and fail the round trip."""
    if isinstance(value, tuple):
        for item in value:
            _non_default_everywhere(item)
        return
    if not dataclasses.is_dataclass(value) or isinstance(value, SamplingParams):
        return
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        assert item not in (None, (), 0, 0.0, ""), f"{type(value).__name__}.{field.name}"
        _non_default_everywhere(item)


def test_the_codec_round_trips_every_field_of_a_plan_and_a_result() -> None:
    plan = StepPlan(
        3,
        (NewRequestPlan("a", (1, 2, 3, 4, 5), (0, 5), 4, 1, SAMPLING, 3, (2**63 + 5,)),),
        (RunningRequestPlan("b", (7, 8), 2, (9,)),),
        ("d",),
        ((1, 2),),
        (BlockWrite(6, 2**64 - 1, (1, 2, 3, 4)),),
    )
    result = StepResult(
        3,
        (
            SampledToken(
                "b",
                12,
                TokenLogprobs(12, -0.5, ((3, -1.5),)),
                1,
                (TokenLogprobs(9, -0.25, ((9, -0.25),)),),
            ),
        ),
        (FailedRequest("e", "EXECUTION_FAILED", "RuntimeError"),),
        (LoadFailure("a", 4, "checksum"),),
        (PromptLogprobs("f", 3, (TokenLogprobs(7, -2.5, ((8, -0.5),)),)),),
    )
    _non_default_everywhere(plan)
    _non_default_everywhere(result)
    assert plan_from_pb(plan_to_pb(plan)) == plan
    assert result_from_pb(result_to_pb(result, 1.5)) == result


def test_random_plans_and_results_round_trip_column_by_column() -> None:
    rng = random.Random(53)
    for _ in range(300):
        ids = [f"r{i}" for i in range(rng.randint(0, 40))]

        def some(most_empty: float) -> tuple[int, ...]:
            empty = rng.random() < most_empty
            return () if empty else tuple(rng.randrange(2**32) for _ in range(rng.randint(1, 3)))

        sparse = rng.random()  # how often a request has no new blocks or drafts this step
        running = tuple(
            RunningRequestPlan(i, some(sparse), rng.randint(1, 9), some(sparse)) for i in ids
        )
        plan = StepPlan(rng.randrange(2**40), (), running, tuple(rng.sample(ids, len(ids) // 3)))
        assert plan_from_pb(plan_to_pb(plan)) == plan

        def logprobs() -> TokenLogprobs:
            top = tuple((rng.randrange(100), -rng.random()) for _ in range(rng.randint(0, 2)))
            return TokenLogprobs(rng.randrange(100), -rng.random(), top)

        sampled = []
        for request_id in ids:
            with_logprobs = rng.random() < 0.3
            accepted = rng.choice((0, 0, 1, 2))
            sampled.append(
                SampledToken(
                    request_id,
                    rng.randrange(2**32),
                    logprobs() if with_logprobs else None,
                    accepted,
                    tuple(logprobs() for _ in range(accepted)) if with_logprobs else (),
                )
            )
        result = StepResult(plan.step_id, tuple(sampled))
        decoded = result_from_pb(result_to_pb(result))
        assert decoded.step_id == result.step_id and len(decoded.sampled) == len(sampled)
        for mine, theirs in zip(decoded.sampled, sampled, strict=True):  # floats as float32
            assert (mine.request_id, mine.token_id) == (theirs.request_id, theirs.token_id)
            assert mine.num_accepted_drafts == theirs.num_accepted_drafts
            assert (mine.logprobs is None) == (theirs.logprobs is None)
            assert len(mine.draft_logprobs) == len(theirs.draft_logprobs)
