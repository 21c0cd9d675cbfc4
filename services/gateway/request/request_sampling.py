"""The sampling parameters a request runs with: its own fields, the model's defaults for what
it leaves unset, validated once for the whole mesh, a seed chosen when none was given; and for
each of n completions, its own seed."""

from __future__ import annotations

import dataclasses
import random

from shared.codec import sampling_from_pb
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2
from shared.sampling import SamplingParams

MAX_COMPLETIONS = 16  # n per request: each completion holds a sequence slot of its own


def resolve_sampling(
    message: common_pb2.SamplingParams,
    model_defaults: common_pb2.SamplingParams | None = None,
    vocab_size: int = 0,
) -> SamplingParams:
    """The parameters in force: fields the request leaves unset take the model's defaults (its
    repository entry, checked when the model loaded), then the engine's; validated (token ids
    against the model's vocabulary, when known); a seed chosen when none was given, so the
    execution record can say exactly what ran."""
    if model_defaults is not None and model_defaults.ListFields():
        merged = common_pb2.SamplingParams()
        merged.CopyFrom(model_defaults)
        merged.MergeFrom(message)
        message = merged
    params = sampling_from_pb(message).validate()
    outside = [token for token, _ in params.logit_bias if vocab_size and token >= vocab_size]
    if outside:
        raise KvmeshError(
            Reason.INVALID_SAMPLING_PARAMS,
            f"logit_bias token {outside[0]} is outside the vocabulary of {vocab_size}",
        )
    if params.seed is None:
        params = dataclasses.replace(params, seed=random.getrandbits(63))
    return params


def num_completions(n: int) -> int:
    """GenerateRequest.n as a count (0 means 1), or INVALID_ARGUMENT."""
    if n > MAX_COMPLETIONS:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT, f"n must be between 1 and {MAX_COMPLETIONS}, got {n}"
        )
    return max(n, 1)


def for_completion(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of n samples with seed + index: the tokens the request would get
    sent alone with that seed."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (1 << 64))
