"""A repository entry's default sampling fills only what a request leaves unset."""

from __future__ import annotations

from services.gateway.request.request_sampling import resolve_sampling
from shared.pb.kvmesh.v1 import common_pb2


def test_request_values_win_over_the_models_defaults() -> None:
    defaults = common_pb2.SamplingParams(temperature=0.5, max_tokens=9, top_p=0.9)
    resolved = resolve_sampling(common_pb2.SamplingParams(max_tokens=5, top_p=1.0), defaults)
    assert (resolved.max_tokens, resolved.temperature, resolved.top_p) == (5, 0.5, 1.0)
    assert resolved.seed is not None  # still resolved whole
    explicit_zero = resolve_sampling(common_pb2.SamplingParams(temperature=0.0), defaults)
    assert explicit_zero.temperature == 0.0  # set to zero is set: not the default's 0.5


def test_without_defaults_the_engine_defaults_apply() -> None:
    plain = resolve_sampling(common_pb2.SamplingParams())
    with_empty = resolve_sampling(common_pb2.SamplingParams(), common_pb2.SamplingParams())
    assert plain.max_tokens == with_empty.max_tokens and plain.temperature == with_empty.temperature
