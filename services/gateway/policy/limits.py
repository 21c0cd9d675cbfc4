"""Per-request size limits, checked in order of cost: the message's bytes before anything reads
its text, then its token counts right after tokenizing, before any tenant charge, routing or
queueing. Tenants' rates and concurrency are rate_limits.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2

DEFAULT_MAX_REQUEST_BYTES = 4 << 20


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # the serialized request (or HTTP body)
    max_prompt_tokens: int = 0  # 0: the model's context length decides
    max_total_tokens: int = 0  # prompt + max_tokens; 0: the context length cuts the output

    def check_size(self, num_bytes: int) -> None:
        if self.max_request_bytes and num_bytes > self.max_request_bytes:
            raise KvmeshError(
                Reason.REQUEST_TOO_LARGE,
                f"the request is {num_bytes} bytes; this gateway takes at most "
                f"{self.max_request_bytes}",
            )

    def prompt_limit(self, model: common_pb2.ModelInfo) -> int:
        """The most prompt tokens a request to `model` may have: one less than its context
        (a prompt must leave room for a token), or --max-prompt-tokens if that is lower."""
        limit = model.max_model_len - 1 if model.max_model_len > 1 else 0
        if self.max_prompt_tokens and (not limit or self.max_prompt_tokens < limit):
            return self.max_prompt_tokens
        return limit

    def check_tokens(self, prompt_tokens: int, max_tokens: int) -> None:
        if self.max_prompt_tokens and prompt_tokens > self.max_prompt_tokens:
            raise KvmeshError(
                Reason.PROMPT_TOO_LONG,
                f"the prompt has {prompt_tokens} tokens; this gateway takes at most "
                f"{self.max_prompt_tokens}",
            )
        total = prompt_tokens + max_tokens
        if self.max_total_tokens and total > self.max_total_tokens:
            raise KvmeshError(
                Reason.PROMPT_TOO_LONG,
                f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) = {total} tokens; this "
                f"gateway takes at most {self.max_total_tokens} per request: lower max_tokens",
            )
