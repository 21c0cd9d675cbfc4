"""Steps a worker runs on its own, on scratch blocks no block table points at: warm-up, the
greedy tokens a fixture is checked with, and a text's next-token distributions (quality
checks). Each holds window blocks only while it runs (window_blocks.py)."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.step_inputs import RequestState
from services.engine_worker.window_blocks import WindowBlocks
from shared.config import EngineConfig
from shared.errors import KvmeshError, Reason
from shared.sampling import SamplingParams


class Worker(Protocol):
    """What these steps use of the worker (worker.py)."""

    config: EngineConfig
    architecture: ModelArchitecture
    kv_shape: KVCacheShape
    window_blocks: WindowBlocks | None
    runner: Any

    def run_scratch(self, scheduled: list[tuple[RequestState, int]]) -> None: ...


def warm_up(worker: Worker) -> None:
    """One mixed prefill + decode step, so the first request pays no first-call costs, and a
    decode-only step: the compiled step has a graph for those too."""
    block = worker.kv_shape.block_size
    tokens = list(range(min(block + 1, worker.architecture.vocab_size)))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prefill = RequestState("warmup-prefill", tokens, [0, 1], 0, params, len(tokens))
    decode = RequestState("warmup-decode", tokens[:2], [0], 1, params, 1)
    rows = [(decode, 1), (prefill, len(tokens))]  # a one-row engine never batches the two
    alone = RequestState("warmup-decode-alone", tokens[:2], [0], 1, params, 1)
    try:
        worker.run_scratch(rows if worker.config.scheduler.max_sampled_rows >= 2 else rows[1:])
        worker.run_scratch([(alone, 1)])
    finally:
        _release(worker, prefill, decode, alone)


def greedy(worker: Worker, prompt_ids: list[int], max_tokens: int, first_block: int) -> list[int]:
    """Greedy tokens (EOS included) on scratch blocks from `first_block`."""
    block = worker.kv_shape.block_size
    num_blocks = -(-(len(prompt_ids) + max_tokens) // block)
    if not prompt_ids or first_block + num_blocks > worker.kv_shape.num_blocks:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT, "a fixture needs a prompt that fits the KV cache"
        )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    state = RequestState(
        "fixture",
        list(prompt_ids),
        list(range(first_block, first_block + num_blocks)),
        0,
        params,
        len(prompt_ids),
    )
    scheduled = len(prompt_ids)
    try:
        for _ in range(max_tokens):
            worker.run_scratch([(state, scheduled)])
            scheduled = 1
    finally:
        _release(worker, state)
    return state.token_ids[len(prompt_ids) :]


def prompt_log_softmax(worker: Worker, prompt_ids: list[int]) -> torch.Tensor:
    """(len - 1, vocab): the next-token log-distribution after each prefix of the prompt
    (torch backend), before any request runs."""
    block = worker.kv_shape.block_size
    num_blocks = -(-len(prompt_ids) // block)
    if len(prompt_ids) < 2 or num_blocks > worker.kv_shape.num_blocks:
        raise KvmeshError(Reason.INVALID_ARGUMENT, "a text that fits the KV cache is needed")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    state = RequestState(
        "score", list(prompt_ids), list(range(num_blocks)), 0, params, len(prompt_ids)
    )
    try:
        if worker.window_blocks is not None:
            worker.window_blocks.cover([(state, len(prompt_ids))])
        return cast(Any, worker.runner).prompt_log_softmax(state)  # the torch backend's alone
    finally:
        _release(worker, state)


def _release(worker: Worker, *states: RequestState) -> None:
    if worker.window_blocks is not None:
        for state in states:
            worker.window_blocks.release(state)
