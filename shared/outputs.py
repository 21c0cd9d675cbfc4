"""What the scheduler reports per request after each step: new tokens and how it finished."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.step import TokenLogprobs


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client


@dataclass(frozen=True)
class RequestOutput:
    """Tokens a request gained in one step; finish_reason set exactly once, on its last output."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache; set when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
