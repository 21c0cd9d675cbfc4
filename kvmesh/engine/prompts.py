"""Prompt inputs as users give them: text, chat messages, or token ids."""

from __future__ import annotations

from typing import Any

from shared.errors import KvmeshError, Reason
from shared.text_tokenizer import TextTokenizer

PromptInput = str | list[int] | dict[str, Any]


def to_token_ids(
    prompt: PromptInput, tokenizer: TextTokenizer | None, vocab_size: int
) -> list[int]:
    """`"text"`, `[ids]`, `{"prompt": text}`, `{"messages": [...]}` or `{"token_ids": [...]}`."""
    if isinstance(prompt, dict):
        keys = [k for k in ("prompt", "messages", "token_ids") if k in prompt]
        if len(keys) != 1:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                "an input needs exactly one of 'prompt', 'messages' or 'token_ids'",
            )
        if keys[0] == "messages":
            messages = prompt["messages"]
            if not isinstance(messages, list) or not messages:
                raise KvmeshError(Reason.INVALID_ARGUMENT, "'messages' must be a non-empty list")
            return _require_tokenizer(tokenizer).encode_chat(messages)
        prompt = prompt[keys[0]]
    if isinstance(prompt, str):
        return _require_tokenizer(tokenizer).encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
            )
        return list(prompt)
    raise KvmeshError(
        Reason.INVALID_ARGUMENT, "a prompt must be text, chat messages or a list of token ids"
    )


def _require_tokenizer(tokenizer: TextTokenizer | None) -> TextTokenizer:
    if tokenizer is None:
        raise KvmeshError(
            Reason.TOKENIZER_UNAVAILABLE,
            "this model ships no tokenizer; send token ids instead of text",
        )
    return tokenizer
