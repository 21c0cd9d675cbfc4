"""A prompt refused as too long before it is tokenized whole, and never one that fits."""

from __future__ import annotations

import random

import pytest

from shared import prompt_bound
from shared.errors import KvmeshError, Reason
from shared.text_tokenizer import TextTokenizer

LIMIT = 8191
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "  jumps",
    "\n\nover",
    "lazy",
    "dog.",
    "12345",
    "café",
    "🚀",
]


def refusal(tokenizer: TextTokenizer, text: str, limit: int = LIMIT) -> str:
    with pytest.raises(KvmeshError) as refused:
        tokenizer.encode(text, max_tokens=limit)
    assert refused.value.reason is Reason.PROMPT_TOO_LONG
    return refused.value.message


def test_a_huge_prompt_is_refused_by_its_byte_count_alone(
    tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a 3.9 MB prompt was tokenized")

    monkeypatch.setattr(tokenizer, "tokenizer", type("Never", (), {"encode": never})())
    text = "word " * 780_000  # 3.9 MB
    assert "3900000 bytes" in refusal(tokenizer, text)


def test_a_long_prompt_is_refused_once_its_count_passes_the_limit(
    tokenizer: TextTokenizer,
) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 2_000  # 90 kB, ~20k tokens
    assert "at least" in refusal(tokenizer, text)
    chat = [{"role": "user", "content": text}]
    with pytest.raises(KvmeshError) as refused:
        tokenizer.encode_chat(chat, max_tokens=LIMIT)
    assert refused.value.reason is Reason.PROMPT_TOO_LONG


def test_a_prompt_at_its_limit_is_never_refused(
    tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted in many small pieces (each edge a chance to over-count): a text whose exact
    count is the limit passes and encodes as it does with no limit."""
    monkeypatch.setattr(prompt_bound, "PIECE_CHARS", 64)
    rng = random.Random(0)
    for _ in range(20):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 800)))
        exact = tokenizer.encode(text)
        assert tokenizer.encode(text, max_tokens=len(exact)) == exact
        chat = [{"role": "user", "content": text}]
        exact_chat = tokenizer.encode_chat(chat)
        assert tokenizer.encode_chat(chat, max_tokens=len(exact_chat)) == exact_chat
