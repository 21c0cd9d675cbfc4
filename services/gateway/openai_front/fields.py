"""The body fields each OpenAI route reads, and OpenAI's own ranges where they are narrower
than the gRPC API's.

A field no route reads is ignored, as vLLM does, and logged once per name and route, so a
client's misspelt or newer field shows in the logs without failing its requests.
"""

from __future__ import annotations

import logging
from typing import Any

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2

log = logging.getLogger("kvmesh.gateway.http")

_SAMPLING = {
    "model", "temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
    "repetition_penalty", "top_k", "seed", "ignore_eos", "disable_speculation",
    "stop_token_ids", "stop", "response_format", "logit_bias", "priority", "timeout_ms",
    "user", "n", "stream", "stream_options", "max_tokens", "logprobs",
    "best_of", "echo", "suffix", "functions", "function_call",  # refused unless the default
}  # fmt: skip
CHAT_FIELDS = _SAMPLING | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
    "top_logprobs",
}  # fmt: skip
COMPLETION_FIELDS = _SAMPLING | {"prompt"}
EMBEDDING_FIELDS = {"model", "input", "dimensions", "encoding_format", "user"}

# OpenAI's documented range; the gRPC API takes any finite temperature >= 0.
MAX_TEMPERATURE = 2.0

_logged: set[tuple[str, str]] = set()


def ignore_unknown(body: dict[str, Any], known: set[str], route: str) -> None:
    for name in body.keys() - known:
        if (route, name) not in _logged:
            _logged.add((route, name))
            log.warning("ignored field", extra={"route": route, "field": name[:64]})


def check_openai_ranges(body: dict[str, Any]) -> None:
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not 0 <= temperature <= MAX_TEMPERATURE:
        raise KvmeshError(
            Reason.INVALID_SAMPLING_PARAMS,
            f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {temperature}",
        )


def zero_top_p_as_top_k(sampling: common_pb2.SamplingParams) -> None:
    """OpenAI's top_p range includes 0, ours is (0, 1]: 0 keeps the most probable token alone,
    as top_k 1 does."""
    if sampling.HasField("top_p") and sampling.top_p == 0:
        sampling.top_p, sampling.top_k = 1.0, 1
