"""`echo` on /v1/completions: the prompt, and with `logprobs` its tokens' logprobs, before
the completion (what lm-eval and other harnesses score text with).

The prompt's logprobs are the engine's (SamplingParams.prompt_logprobs), asked for when the
answer shows them, and for a prompt of token ids in any case: their bytes are its echoed text.
The first prompt token has no logprob: OpenAI and vLLM render it as null.
"""

from __future__ import annotations

from shared.pb.kvmesh.v1 import common_pb2, inference_pb2


def ask_for_prompt(
    sampling: common_pb2.SamplingParams,
    prompt: inference_pb2.GenerateRequest,
    logprobs: bool,
    only: bool,
) -> None:
    """`only`: max_tokens 0, the prompt scored and nothing shown of the one token computed
    with its last row."""
    if only:
        sampling.max_tokens = 1
    if logprobs or prompt.WhichOneof("input") == "token_ids":
        sampling.prompt_logprobs = sampling.logprobs if logprobs else 0


def echoed_prompt(
    prompt: inference_pb2.GenerateRequest, delta: inference_pb2.Delta
) -> tuple[str, list[common_pb2.TokenLogprobs]]:
    """The prompt's text and its logprob entries, from the first delta of its completion."""
    entries = list(delta.prompt_logprobs)
    if prompt.WhichOneof("input") == "text":
        return prompt.text, entries
    text = b"".join(entry.token_bytes for entry in entries)
    return text.decode("utf-8", errors="replace"), entries
