"""What the scheduler reports per request after each step: new tokens and how it finished."""

from __future__ import annotations

from dataclasses import dataclass

from shared.pb.kvmesh.v1.common_pb2 import FinishReason  # the one definition: common.proto
from shared.step import FailedRequest, TokenLogprobs

__all__ = ["FinishReason", "RequestOutput", "finish_reason_label"]


def finish_reason_label(reason: FinishReason) -> str:
    """The lower-case name logs, metrics, spans and the OpenAI API use: "stop", "length"..."""
    return FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


@dataclass(slots=True)  # per request every step: slots, not frozen, to cost half as much
class RequestOutput:
    """Tokens a request gained in one step; finish_reason set exactly once, on its last output."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache; set when finished
    num_loaded_tokens: int = 0  # prompt tokens loaded from a KV tier; set when finished
    failure: FailedRequest | None = None  # the step could not compute it: it ended failed
    num_draft_tokens: int = 0  # speculative drafts proposed for it, and accepted; when finished
    num_accepted_drafts: int = 0
    # With its first token, when it asked: positions 1.. of its prompt (prompt_scores.py).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.failure is not None
