"""Dataclass <-> proto conversions and the rich error model round-trip without loss."""

from __future__ import annotations

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
    NewRequestPlan,
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
