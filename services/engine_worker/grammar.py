"""Constrained decoding with llguidance: response formats compiled into token matchers.

A `GrammarCompiler` holds the model's tokenizer as llguidance sees it and one pristine
matcher per response format (LRU), so a format compiles once and each request gets a cheap
copy. Before sampling, a constrained row's logits keep only the tokens its matcher allows
(the end token once the output is complete); after sampling, the matcher consumes the token.
A recomputed request (after preemption) replays its output so far into a fresh copy.
Compiles run on a thread of their own (PrepareFormat) while steps copy from the cache.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch
from prometheus_client import Histogram

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from services.engine_worker.step_failures import GrammarFailed
from shared.errors import KvmeshError, Reason
from shared.runtime.metrics import TOKEN_SECONDS
from shared.sampling import ResponseFormat
from shared.text_tokenizer import TextTokenizer

MAX_CACHED_FORMATS = 256
MASK_SECONDS = Histogram(
    "kvmesh_grammar_mask_seconds",
    "Computing one constrained row's allowed-token mask before sampling",
    buckets=TOKEN_SECONDS,
)
ANY_JSON_OBJECT = json.dumps({"type": "object"})
# Compact JSON: free whitespace lets a sampling model wander in newlines up to max_tokens.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def _invalid(response_format: ResponseFormat, problem: str) -> KvmeshError:
    return KvmeshError(Reason.INVALID_SCHEMA, f"invalid {response_format.kind}: {problem}")


def grammar_of(response_format: ResponseFormat) -> str:
    """The llguidance grammar of a response format; INVALID_SCHEMA naming what is wrong."""
    kind, spec = response_format.kind, response_format.spec
    try:
        if kind in ("json_schema", "json_object"):
            schema = ANY_JSON_OBJECT if kind == "json_object" else spec
            try:
                json.loads(schema)
            except json.JSONDecodeError as error:
                raise _invalid(response_format, f"not JSON: {error}") from None
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.LLMatcher.grammar_from_lark(spec)
    except ValueError as error:
        raise _invalid(response_format, str(error)) from None


class GrammarCompiler:
    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._compiled: collections.OrderedDict[ResponseFormat, llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # the cache, between the compile and the step threads

    def compiled(self, response_format: ResponseFormat) -> bool:
        with self._lock:
            return response_format in self._compiled

    def matcher(self, response_format: ResponseFormat) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the output (compiled here if not cached)."""
        with self._lock:
            pristine = self._compiled.get(response_format)
            if pristine is not None:
                self._compiled.move_to_end(response_format)
                return pristine.deep_copy()
        pristine = llguidance.LLMatcher(self.tokenizer, grammar_of(response_format))
        if pristine.is_error():
            raise _invalid(response_format, pristine.get_error())
        probe = pristine.deep_copy()  # a schema that admits no output fails at its first mask
        allowed_tokens(probe, self.vocab_size, raising=False)
        if probe.is_error():
            raise _invalid(response_format, f"it admits no output ({_first_line(probe)})")
        with self._lock:
            self._compiled[response_format] = pristine
            if len(self._compiled) > MAX_CACHED_FORMATS:
                self._compiled.popitem(last=False)
        return pristine.deep_copy()


def _first_line(matcher: llguidance.LLMatcher) -> str:
    return (matcher.get_error().splitlines() or ["error"])[0]


def allowed_tokens(
    matcher: llguidance.LLMatcher, vocab_size: int, raising: bool = True
) -> torch.Tensor:
    """(vocab,) bool: the tokens the matcher allows next; GrammarFailed if it can go no
    further (never a free sample past a broken grammar)."""
    started = time.perf_counter()
    bits = np.unpackbits(
        np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
    )
    if raising and matcher.is_error():
        raise GrammarFailed(f"the response format's grammar failed: {_first_line(matcher)}")
    allowed = torch.from_numpy(bits[:vocab_size].astype(bool))
    MASK_SECONDS.observe(time.perf_counter() - started)
    return allowed
