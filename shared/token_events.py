"""A request's tokens that are still waiting, joined by the next step's.

Where a stage falls behind (a scheduler's reply still being written, a gateway's relay still
busy with the last delta), a step's tokens for a request join those already waiting for it,
as vLLM's output collector merges: the stage then does its per-event work once for several
tokens instead of queueing an event a token, so a backlog shrinks instead of growing.
"""

from __future__ import annotations

from shared.pb.kvmesh.v1 import scheduler_pb2


def join_tokens(waiting: scheduler_pb2.SubmitTokens, later: scheduler_pb2.SubmitTokens) -> None:
    """`later`'s tokens after `waiting`'s (whose first-token timings, if any, stay)."""
    waiting.token_ids.extend(later.token_ids)
    waiting.logprobs.extend(later.logprobs)
    waiting.prompt_logprobs.extend(later.prompt_logprobs)
