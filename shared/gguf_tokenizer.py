"""A GGUF file's vocabulary as an HF `tokenizers` object, as transformers' GGUF loader builds it.

Two kinds cover the files people run: byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM,
Llama 3, Qwen) split by the regex its `tokenizer.ggml.pre` names, and SentencePiece BPE ("llama":
Llama 2, Mistral, Phi-3, Gemma) with byte fallback, whose merges a file seldom lists: they are
recovered from the vocabulary, each token's best split ranked by its score (Gemma: by its place
in the file, which is its merge order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types matched whole in text
SPACE_MARK = "\u2581"  # SentencePiece's visible space

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split its merges were learned on (others: GPT-2's own regex).
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
SUPPORTED_MODELS = ("gpt2", "llama")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + shifted
            shifted += 1
    return {chr(char): byte for byte, char in chars.items()}


BYTE_OF_CHAR = _byte_level_alphabet()


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer | None:
    """None where the file has no vocabulary, or one of another kind (T5's unigram, RWKV's):
    its model then takes token ids only."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if tokens is None or kind not in SUPPORTED_MODELS:
        return None
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    build = _byte_level if kind == "gpt2" else _sentencepiece
    tokenizer = build(metadata, tokens)
    # Control tokens are special; user-defined ones (`<think>`) plain, but matched whole too. A
    # byte-level vocabulary's control token spelled outside its alphabet is a mislabel, and a
    # user-defined one its vocabulary respelled (Gemma's spaces) is left to it.
    alphabet = set(BYTE_OF_CHAR) if kind == "gpt2" else None
    vocab = tokenizer.get_vocab()
    typed = list(zip(tokens, types, strict=False))
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind_of in typed
            if kind_of == _CONTROL and (alphabet is None or set(token) <= alphabet)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind_of in typed
            if kind_of == _USER_DEFINED and token in vocab
        ]
    )
    return tokenizer


def adds_bos(metadata: dict[str, Any]) -> bool:
    """llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise."""
    default = metadata.get("tokenizer.ggml.model") == "llama"
    return bool(metadata.get("tokenizer.ggml.add_bos_token", default))


def _byte_level(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _file_merges(metadata) or []
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = metadata.get("tokenizer.ggml.pre")
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":  # digits one by one, then GPT-2's regex
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    """Llama's: a space prepended to the text's start, removed again when decoding. Phi-3's: the
    prefix and every space written by a normalizer. Gemma's: no prefix, runs of spaces stored as
    spaces (respelled here as the tokens the text becomes)."""
    arch = metadata.get("general.architecture", "")
    gemma = arch.startswith("gemma")
    if gemma:
        tokens = [SPACE_MARK * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _file_merges(metadata)
    if merges is None:
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        rank: Callable[[int], float] = (lambda i: -i) if gemma else (lambda i: scores[i])
        merges = _recovered_merges(tokens, vocab, rank)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[unk] if unk is not None else None,
        )
    )
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", SPACE_MARK)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE_MARK), normalizers.Replace(" ", SPACE_MARK)]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE_MARK, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _file_merges(metadata: dict[str, Any]) -> list[tuple[str, str]] | None:
    listed = metadata.get("tokenizer.ggml.merges")
    if listed is None:
        return None
    return [(left, right) for left, right in (m.split(" ", 1) for m in listed)]


def _recovered_merges(
    tokens: list[str], vocab: dict[str, int], rank: Callable[[int], float]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token's rank
    (best first), then by the longer left and right parts, then by the merged token's place
    and the parts' ids (transformers' `generate_merges` order)."""
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                key = (-rank(index), -len(left), -len(right), index, vocab[left], vocab[right])
                found.append((*key, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]
