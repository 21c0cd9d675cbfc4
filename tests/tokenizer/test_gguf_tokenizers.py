"""GGUF vocabularies of every kind people download, against transformers' GGUF loader on the same
file: SentencePiece BPE as Llama 2 / Mistral, Phi-3 and Gemma files carry it (merges recovered
from the scores, or from the file's order for Gemma), and byte-level BPE with the Qwen2 and
Llama 3 splits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shared.gguf_metadata import read_gguf_metadata
from shared.model_paths import default_model_path
from shared.text_tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    " leading space and  two  spaces",
    "The lighthouse keeper counted 1234567 waves,\nthen slept.\n\n",
    "naïve café — 東京 🚀 done",
    "   ",
    "<s> is not a control token in text, nor </s>",
    "x" * 40,
]


def spm_vocabulary(size: int = 0, seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte tokens, then pieces of the lighthouse text: every prefix of
    every word (with and without its leading space mark), and overlapping two- and three-letter
    pieces, with random scores and in an order of their own, so that which merge comes first
    decides the tokens."""
    text = (Path(__file__).parents[2] / "loadtest" / "texts" / "lighthouse.txt").read_text()
    words = sorted({w.strip(".,;:!?\"'()") for w in text.split()} - {""})[:400]
    rng = random.Random(seed)
    names: set[str] = {"\u2581" * run for run in (2, 3, 4)}
    for word in words:
        for spelled in (word, "\u2581" + word):
            names.update(spelled[:end] for end in range(1, len(spelled) + 1))
            names.update(spelled[i : i + n] for n in (2, 3) for i in range(len(spelled) - n + 1))
    order = sorted(names)
    rng.shuffle(order)
    if size:  # a model's vocabulary size: the shortest pieces kept
        order = sorted(order, key=len)[: size - 259]
        rng.shuffle(order)
    pieces = {piece: -rng.uniform(0, 20) for piece in order}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *pieces.values()]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    return tokens, scores, types


def _write(path: Path, arch: str, fill) -> None:  # type: ignore[no-untyped-def]
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _sentencepiece_file(path: Path, arch: str) -> None:
    _write(path, arch, sentencepiece_metadata(arch))


def sentencepiece_metadata(arch: str, size: int = 0):  # type: ignore[no-untyped-def]
    """A function writing a SentencePiece vocabulary's metadata as `arch`'s files carry it."""
    tokens, scores, types = spm_vocabulary(size)
    if arch.startswith("gemma"):  # Gemma stores runs of spaces as spaces
        tokens = [" " * len(t) if set(t) == {"\u2581"} else t for t in tokens]

    def fill(writer) -> None:  # type: ignore[no-untyped-def]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    return fill


def _byte_level_file(path: Path, pre: str) -> None:
    metadata = read_gguf_metadata(default_model_path())

    def fill(writer) -> None:  # type: ignore[no-untyped-def]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(metadata["tokenizer.ggml.tokens"])
        writer.add_token_types(metadata["tokenizer.ggml.token_type"])
        writer.add_token_merges(metadata["tokenizer.ggml.merges"])
        writer.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
        writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])

    _write(path, "qwen2" if pre == "qwen2" else "llama", fill)


def _reference(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_does(
    arch: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{arch}.gguf"
    _sentencepiece_file(path, arch)
    ours, reference = load_tokenizer(str(path)), _reference(path)
    assert ours is not None
    for text in TEXTS:
        expected = reference(text).input_ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True)
    # Byte fallback, not <unk>: an emoji is its four UTF-8 bytes.
    rocket = ours.encode("🚀", add_special_tokens=False)
    assert ours.tokenizer.id_to_token(rocket[-1]) == "<0x80>"
    # Each token's own bytes (logprobs): the byte tokens' bytes, spaces where the marks are,
    # the prefix space the vocabulary adds at the start (Gemma's adds none).
    text = "naïve keeper 🚀"
    ids = ours.encode(text, add_special_tokens=False)
    prefix = "" if arch.startswith("gemma") else " "
    assert b"".join(ours.token_bytes(ids)) == (prefix + text).encode()


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_a_byte_level_vocabulary_splits_as_its_pre_tokenizer_says(pre: str, tmp_path: Path) -> None:
    path = tmp_path / f"{pre}.gguf"
    _byte_level_file(path, pre)
    ours, reference = load_tokenizer(str(path)), _reference(path)
    assert ours is not None
    for text in TEXTS:
        assert ours.encode(text) == reference(text).input_ids, text
    # Qwen2 splits digits one by one, Llama 3 in threes: the file's `pre` decides.
    pieces = ours.tokenizer.pre_tokenizer.pre_tokenize_str("1234567")
    assert len(pieces) == (7 if pre == "qwen2" else 3)
