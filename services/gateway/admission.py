"""Checking and resolving a GenerateRequest before anything is queued.

Defaults are resolved here once (every sampling field set, a seed chosen when none was given)
so the execution record can state exactly what ran.
"""

from __future__ import annotations

import dataclasses
import random

import grpc

from services.gateway.call_context import CallContext
from services.gateway.text_stream import tokenizer_failure
from shared.codec import sampling_from_pb, sampling_to_pb
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from shared.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def resolve_sampling(
    message: common_pb2.SamplingParams, model_defaults: common_pb2.SamplingParams | None = None
) -> common_pb2.SamplingParams:
    """Validated, every field set, with a seed: the parameters in force. Fields the request
    leaves unset take the model's defaults (its repository entry), then the engine's."""
    if model_defaults is not None and model_defaults.ListFields():
        merged = common_pb2.SamplingParams()
        merged.CopyFrom(model_defaults)
        merged.MergeFrom(message)
        message = merged
    params: SamplingParams = sampling_from_pb(message)
    if params.seed is None:
        params = dataclasses.replace(params, seed=random.getrandbits(63))
    return sampling_to_pb(params)


def check_stop_strings(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
        )
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters",
            )


def time_remaining(context: CallContext, timeout_ms: int) -> float | None:
    """Seconds left: the sooner of the client's gRPC deadline and the request's timeout_ms."""
    remaining = context.time_remaining()
    if timeout_ms:
        remaining = timeout_ms / 1e3 if remaining is None else min(remaining, timeout_ms / 1e3)
    return remaining


async def prompt_token_ids(
    request: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest,
    tokenizer: tokenizer_pb2_grpc.TokenizerStub,
    model: common_pb2.ModelInfo,
    timeout: float | None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)  # type: ignore[union-attr]
        bad = [t for t in ids if t >= model.vocab_size]
        if bad:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})",
            )
    elif kind == "text":
        encode = tokenizer_pb2.EncodeRequest(text=request.text, model=model.name)
        ids = await _encode(tokenizer, encode, timeout, metadata)
    elif kind == "chat":
        encode = tokenizer_pb2.EncodeRequest(chat=request.chat, model=model.name)
        ids = await _encode(tokenizer, encode, timeout, metadata)
    else:
        raise KvmeshError(Reason.INVALID_ARGUMENT, "give text, chat or token_ids as the input")
    if not ids:
        raise KvmeshError(Reason.EMPTY_PROMPT, "the prompt has no tokens")
    return ids


async def _encode(
    tokenizer: tokenizer_pb2_grpc.TokenizerStub,
    request: tokenizer_pb2.EncodeRequest,
    timeout: float | None,
    metadata: tuple[tuple[str, str], ...],
) -> list[int]:
    try:
        reply = await tokenizer.Encode(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as error:
        raise tokenizer_failure(error) from None
    return list(reply.token_ids)
