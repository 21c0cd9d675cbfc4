"""`--backend sim`: the serving path measured on any machine, with no model computed.

A step takes a set wall time (`--sim-step-ms`, plus `--sim-prefill-ms-per-1k-tokens` for its
prompt tokens), slept until its deadline, never spun, and each request's next token is drawn
from a key (its seed; none for a greedy request; its id for an unseeded sampled one), its
position and the token before it: the same tokens alone or in any batch, over the model's own
vocabulary, so text detokenizes for real. Everything around it is the
real mesh: the tokenizer, the scheduler's batching and KV blocks (a real pool, its pages never
touched), stop ids, max_tokens, response formats (a drawn token the format forbids moves to
the next it allows), logprobs of the requested shape. Never a default backend.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.grammar import allowed_tokens
from services.engine_worker.kv_cache import KVCache, KVCacheShape
from services.engine_worker.persistent_batch import BlockTables
from services.engine_worker.step_failures import failure_of
from services.engine_worker.step_inputs import RequestState
from shared.config import EngineConfig
from shared.step import FailedRequest, PromptLogprobs, SampledToken, TokenLogprobs

_MASK = (1 << 64) - 1
UNSEEDED = 0  # a greedy request's key: its tokens follow from its context alone


def drawn_token(key: int, position: int, previous: int, vocab_size: int) -> int:
    """A request's token at `position` after `previous`: splitmix64 over the three."""
    x = (key * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + previous) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) % vocab_size


def _key(state: RequestState) -> int:
    """A seeded request draws from its seed; a greedy one from the context alone (as a model's
    argmax would: `n` greedy completions agree); an unseeded sampled one from its own id."""
    sampling = state.sampling
    if sampling.seed is not None:
        return sampling.seed & _MASK
    if sampling.temperature == 0:
        return UNSEEDED
    return zlib.crc32(state.request_id.encode()) + 1


class Runner:
    block_tables: BlockTables | None = None
    scores_prompts = False  # no distribution to score a prompt with: refused by the worker
    weights_resident_bytes = 0

    def __init__(
        self,
        arch: ModelArchitecture,
        weights: Any,  # none is loaded: the serving path is what runs
        kv_shape: KVCacheShape,
        max_model_len: int,
        dtype: torch.dtype,
        config: EngineConfig,
    ) -> None:
        self.vocab_size = arch.vocab_size
        self.step_seconds = config.sim.step_ms / 1000
        self.prefill_seconds_per_token = config.sim.prefill_ms_per_1k_tokens / 1e6
        # A real pool, so KV tiers and handovers move real blocks; its pages stay untouched.
        self.kv_cache = KVCache(kv_shape, dtype, "cpu")

    @staticmethod
    def step_memory_bytes(
        arch: ModelArchitecture, dtype: torch.dtype, config: EngineConfig, max_model_len: int
    ) -> int:
        return 0

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.num_bytes

    @property
    def kv_pool(self) -> Any:
        return self.kv_cache

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        self.kv_cache.copy_blocks(pairs)

    def take_prompt_scores(self) -> tuple[PromptLogprobs, ...]:
        return ()

    def step(
        self, scheduled: list[tuple[RequestState, int]], rng: torch.Generator
    ) -> tuple[tuple[RequestState, ...], list[SampledToken | FailedRequest]]:
        deadline = time.monotonic() + self.step_seconds
        sampling: list[RequestState] = []
        for state, num_new in scheduled:
            prompt_left = state.prompt_len - state.num_computed_tokens
            deadline += max(0, min(num_new, prompt_left)) * self.prefill_seconds_per_token
            if state.num_computed_tokens + num_new >= len(state.token_ids):
                sampling.append(state)
        outcomes: list[SampledToken | FailedRequest] = []
        for state in sampling:
            try:
                outcomes.append(self._sample(state))
            except Exception as error:  # this request's failure, kept to it
                outcomes.append(failure_of(state.request_id, error))
        if (left := deadline - time.monotonic()) > 0:
            time.sleep(left)
        return tuple(sampling), outcomes

    def _sample(self, state: RequestState) -> SampledToken:
        """Its next token; drafts it verifies are all rejected (the drawn token follows the
        last known one)."""
        position = len(state.token_ids) - state.num_drafts
        key = _key(state)
        token = drawn_token(key, position, state.token_ids[position - 1], self.vocab_size)
        if state.matcher is not None:
            allowed = allowed_tokens(state.matcher, self.vocab_size)
            if not allowed[token]:
                later = allowed.roll(-token).nonzero()  # the next allowed, cyclically
                token = (token + int(later[0])) % self.vocab_size if len(later) else token
            state.matcher.consume_token(token)
        top = state.sampling.logprobs
        if top is None:
            return SampledToken(state.request_id, token)
        # The requested shape: the token itself first, then its neighbours, all but unlikely.
        ranked = [(token, 0.0), *(((token + i) % self.vocab_size, -30.0) for i in range(1, top))]
        return SampledToken(state.request_id, token, TokenLogprobs(token, 0.0, tuple(ranked[:top])))
