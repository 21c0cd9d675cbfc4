"""The completions route's `prompt`: one prompt, or a batch of them.

A string or a list of token ids is one prompt; a list of strings or of token-id lists is a
batch, each prompt its own request (its own n completions), answered as one response whose
choices go prompt by prompt: prompt i's completion j is choice i * n + j, as vLLM numbers them.
"""

from __future__ import annotations

from typing import Any

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2, inference_pb2

# Prompts in one request: each is admitted, routed and rate-limited as its own request.
MAX_BATCH_PROMPTS = 64
UINT32_MAX = 2**32 - 1


def _invalid(message: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_ARGUMENT, message)


def is_token_ids(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in values
    )


def _one(prompt: Any) -> inference_pb2.GenerateRequest | None:
    if isinstance(prompt, str):
        return inference_pb2.GenerateRequest(text=prompt)
    if prompt and is_token_ids(prompt):
        return inference_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt))
    return None


def parse_prompts(prompt: Any) -> list[inference_pb2.GenerateRequest]:
    """One request per prompt, each holding only its input."""
    one = _one(prompt)
    if one is not None:
        return [one]
    batch = [_one(p) for p in prompt] if isinstance(prompt, list) and prompt else [None]
    requests = [request for request in batch if request is not None]
    if len(requests) != len(batch):
        raise _invalid(
            "'prompt' must be a string, a list of token ids, or a non-empty list of either"
        )
    if len(requests) > MAX_BATCH_PROMPTS:
        raise _invalid(f"'prompt' holds {len(requests)} prompts; at most {MAX_BATCH_PROMPTS}")
    return requests


def one_per_prompt(
    common: inference_pb2.GenerateRequest, prompts: list[inference_pb2.GenerateRequest]
) -> list[inference_pb2.GenerateRequest]:
    """`common` (the first prompt's request, every field parsed) again for each other prompt."""
    requests = [common]
    for prompt in prompts[1:]:
        request = inference_pb2.GenerateRequest()
        request.CopyFrom(common)
        if prompt.WhichOneof("input") == "text":
            request.text = prompt.text
        else:
            request.token_ids.CopyFrom(prompt.token_ids)
        requests.append(request)
    return requests
