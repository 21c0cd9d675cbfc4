"""A prompt refused as too long before it is tokenized whole, and never one that fits."""

from __future__ import annotations

import random
import string

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


class CountingEncoder:
    """The tokenizer's encoder, counting the characters it was given."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.chars = 0

    def encode(self, text: str, **kwargs: object) -> object:
        self.chars += len(text)
        return self.inner.encode(text, **kwargs)  # type: ignore[attr-defined]


def test_symbols_with_no_space_are_refused_after_a_piece_not_tokenized_whole(
    tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1.3 MB of random ASCII symbols: too few bytes for the byte count to refuse (162-byte
    tokens), and no space to cut at."""
    rng = random.Random(0)
    symbols = string.ascii_letters + string.digits + string.punctuation
    text = "".join(rng.choice(symbols) for _ in range(1_300_000))
    counting = CountingEncoder(tokenizer.tokenizer)
    monkeypatch.setattr(tokenizer, "tokenizer", counting)
    assert "at least" in refusal(tokenizer, text)
    assert counting.chars <= 2 * 2 * prompt_bound.PIECE_CHARS  # two pieces at most, not 1.3 MB
    run = "!" * 100_000  # one class, no space: cut anywhere, still counted in pieces
    counting.chars = 0
    assert "at least" in refusal(tokenizer, run, limit=2_000)
    assert counting.chars <= 2 * 2 * prompt_bound.PIECE_CHARS


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
        glued = "".join(rng.choice(WORDS).strip() for _ in range(rng.randint(200, 800)))
        exact = tokenizer.encode(glued)  # no space: cut where letters meet other characters
        assert tokenizer.encode(glued, max_tokens=len(exact)) == exact
