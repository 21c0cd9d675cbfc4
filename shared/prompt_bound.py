"""A prompt refused as too long before it is tokenized whole.

A token is at least one byte of the text (a BOS or a SentencePiece prefix adds at most two
more) and at most the vocabulary's longest token. So a text of B bytes has at most B + 2 tokens
and at least B / longest: past the limit by the lower bound it is refused at once, within it by
the upper bound it is encoded as usual. In between it is counted in pieces that end before a
space following a non-space, where byte-level pre-tokenizers split anyway (failing that, where
letters meet other characters, then anywhere), and refused as soon as the count passes the
limit: a 3.9 MB prompt costs a byte count, not 11 s of tokenizing, and 1.3 MB of symbols with no
space one piece's count, not 2.5 s.
"""

from __future__ import annotations

import math
import re

from tokenizers import Tokenizer

from shared.errors import KvmeshError, Reason

PIECE_CHARS = 1 << 14  # about 9 ms of encoding: what another prompt may wait behind
_SPLIT = re.compile(r"(?<=\S)(?=\s)")
# Letters against anything else: a pre-token's edge for byte-level BPE, a likely one elsewhere.
_CLASS_CHANGE = re.compile(r"(?<=[^\W\d_])(?=[\W\d_])|(?<=[\W\d_])(?=[^\W\d_])")


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """An upper bound on the text bytes one token stands for (UTF-8 of its vocabulary string,
    which for byte-level vocabularies over-counts: a safe side)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8")) for token in vocab), default=1)


def _too_long(detail: str, limit: int) -> KvmeshError:
    return KvmeshError(Reason.PROMPT_TOO_LONG, f"{detail}, past the limit of {limit} prompt tokens")


def _pieces(text: str) -> list[str]:
    """Pieces of PIECE_CHARS to twice that; each cut at the best edge the window has."""
    pieces, start = [], 0
    while len(text) - start > 2 * PIECE_CHARS:
        window = (start + PIECE_CHARS, start + 2 * PIECE_CHARS)
        split = _SPLIT.search(text, *window) or _CLASS_CHANGE.search(text, *window)
        cut = window[0] if split is None else split.start()  # a run of one class: anywhere
        pieces.append(text[start:cut])
        start = cut
    return [*pieces, text[start:]]


def check_length(tokenizer: Tokenizer, text: str, limit: int, longest: int) -> None:
    """PROMPT_TOO_LONG when `text` certainly has more than `limit` tokens (0: no limit)."""
    if limit <= 0 or 4 * len(text) + 2 <= limit:  # UTF-8 takes at most 4 bytes a character
        return
    num_bytes = len(text.encode("utf-8", "surrogatepass"))
    if num_bytes + 2 <= limit:
        return
    if num_bytes > limit * longest:
        at_least = math.ceil(num_bytes / longest)
        raise _too_long(f"the prompt is {num_bytes} bytes, at least {at_least} tokens", limit)
    count = 0
    for piece in _pieces(text):
        # Less one a piece: a piece's edge could cost a token the whole text would not.
        count += len(tokenizer.encode(piece, add_special_tokens=False).ids) - 1
        if count > limit:
            raise _too_long(f"the prompt has at least {count} tokens", limit)
