"""The torch backend's step: ragged batch -> CausalLM forward on the KV pool -> sampler.

The reference implementation: every other backend is checked against it. It runs on the CPU;
KVMESH_TORCH_DEVICE=cuda runs the same torch code on a GPU, for benchmarks that compare the
cupy backend with plain torch on the same device (sampling stays on the CPU).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.weights import ModelWeights
from services.engine_worker.kv_cache import KVCache, KVCacheShape
from services.engine_worker.persistent_batch import BlockTables
from services.engine_worker.prompt_scores import score_prompts
from services.engine_worker.step_formats import DTYPES
from services.engine_worker.step_inputs import FlatBatch, RequestState, flatten, unique_states
from services.engine_worker.torch_backend.batch import build_batch
from services.engine_worker.torch_backend.compiled_model import CompiledCausalLM, can_compile
from services.engine_worker.torch_backend.graph_batch import GraphBatch
from services.engine_worker.torch_backend.model import CausalLM
from services.engine_worker.torch_backend.weights import Int4Source, TorchWeights
from services.engine_worker.verification import sample_and_verify
from shared.config import EngineConfig
from shared.step import FailedRequest, PromptLogprobs, SampledToken


class Runner:
    # The worker's persistent block tables (persistent_batch.py); set by the worker once built.
    block_tables: BlockTables | None = None
    scores_prompts = True  # computes prompt logprobs (prompt_scores.py)

    def __init__(
        self,
        arch: ModelArchitecture,
        weights: ModelWeights | TorchWeights,  # the latter packed already (a prepared model)
        kv_shape: KVCacheShape,
        max_model_len: int,
        dtype: torch.dtype,
        config: EngineConfig,
        int4: Int4Source | None = None,
    ) -> None:
        self.arch = arch
        self.device = torch.device(os.environ.get("KVMESH_TORCH_DEVICE", "cpu"))
        if isinstance(weights, TorchWeights):
            torch_weights = weights
        else:
            moved = weights if self.device.type == "cpu" else _moved(weights, self.device)
            torch_weights = TorchWeights.from_float(moved, config.weights, dtype, int4)
        self.weights_resident_bytes = torch_weights.resident_bytes
        self.model = CausalLM(arch, torch_weights, max_model_len, dtype)
        self.model.move_tables(self.device)
        # The worker resolved both (step_formats.py): compile is auto only for a packed model on
        # the CPU with a compiler, and only then may the pool's dtype differ from the activations'.
        kv_dtype = DTYPES[config.cache.dtype]
        self.kv_cache = KVCache(kv_shape, kv_dtype, str(self.device))
        self._prompt_scores: list[PromptLogprobs] = []  # steps' scores the worker has not taken
        self.compiled = None
        if config.compile == "auto" and arch.llama_layer and can_compile(torch_weights):
            self.compiled = CompiledCausalLM(self.model, self.kv_cache)
        if self.compiled is None and kv_dtype != dtype:
            raise ValueError(f"a {kv_dtype} KV cache needs the compiled step")

    @staticmethod
    def step_memory_bytes(
        arch: ModelArchitecture, dtype: torch.dtype, config: EngineConfig, max_model_len: int
    ) -> int:
        """A step's largest activations (an upper bound: torch allocates them as it goes)."""
        limits = config.scheduler
        return arch.step_workspace_bytes(
            limits.max_num_batched_tokens, limits.max_sampled_rows, dtype.itemsize
        )

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.num_bytes

    @property
    def kv_pool(self) -> Any:
        """The pool blocks are read from and loaded into (read_block, write_block)."""
        return self.kv_cache

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        self.kv_cache.copy_blocks(pairs)

    def step(
        self, scheduled: list[tuple[RequestState, int]], rng: torch.Generator
    ) -> tuple[tuple[RequestState, ...], list[SampledToken | FailedRequest]]:
        """Runs the scheduled tokens; returns the requests that sampled, and for each its token
        or, when its own sampling raised, its failure."""
        tables = None if self.block_tables is None else self.block_tables.table
        if self.compiled is not None:
            flat = flatten(scheduled, self.kv_cache.shape.block_size, tables)
            rows = self.compiled.forward(GraphBatch.of(flat), flat.chained_decodes)
            logits = self._scored(rows, flat)
            states = tuple(flat.sampling_states)
            return unique_states(states), sample_and_verify(logits, states, rng)
        arch = self.arch
        batch = build_batch(
            scheduled,
            self.kv_cache.shape.block_size,
            arch.num_kv_heads,
            arch.num_heads,
            arch.head_dim,
            tables,
            self.model.window,
            bool(self.kv_cache.shape.window_layers),
        )
        if self.device.type != "cpu":  # the tensors only: the request states stay as they are
            batch = dataclasses.replace(
                batch,
                input_ids=batch.input_ids.to(self.device),
                positions=batch.positions.to(self.device),
                meta=_moved(batch.meta, self.device),
                sample_rows=batch.sample_rows.to(self.device),
            )
        logits = self.model.forward(
            batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.sample_rows
        )
        logits = self._scored(logits.cpu(), batch.flat)
        states = batch.sampling_states
        return unique_states(states), sample_and_verify(logits, states, rng)

    def _scored(self, logits: torch.Tensor, flat: FlatBatch) -> torch.Tensor:
        """The sampled rows' logits; the prompt-scoring rows after them go to score_prompts."""
        if not flat.prompt_rows:
            return logits
        num_sampled = len(flat.sample_rows)
        self._prompt_scores += score_prompts(logits[num_sampled:], flat)
        return logits[:num_sampled]

    def take_prompt_scores(self) -> tuple[PromptLogprobs, ...]:
        """What the steps since the last call scored. A step rerun request by request (one
        that raised) may give a chunk twice: the scheduler keeps each position once."""
        scores, self._prompt_scores = tuple(self._prompt_scores), []
        return scores

    def prompt_log_softmax(self, state: RequestState) -> torch.Tensor:
        """(prompt_len - 1, vocab): the next-token log-distribution after each prompt prefix,
        from one prefill of `state` (on its blocks) with logits at every position."""
        tokens = len(state.token_ids)
        rows = torch.arange(tokens - 1)
        if self.compiled is not None:
            flat = flatten([(state, tokens)], self.kv_cache.shape.block_size)
            graph_batch = dataclasses.replace(GraphBatch.of(flat), sample_rows=rows)
            return torch.log_softmax(self.compiled.forward(graph_batch), dim=-1)
        batch = build_batch(
            [(state, tokens)],
            self.kv_cache.shape.block_size,
            self.arch.num_kv_heads,
            self.arch.num_heads,
            self.arch.head_dim,
            window=self.model.window,
            window_blocks=bool(self.kv_cache.shape.window_layers),
        )
        logits = self.model.forward(
            batch.input_ids, batch.positions, self.kv_cache, batch.meta, rows
        )
        return torch.log_softmax(logits, dim=-1)


def _moved(value, device: torch.device):
    """Every tensor inside (nested frozen dataclasses and tuples) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved(item, device) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _moved(getattr(value, f.name), device)
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), (torch.Tensor, tuple))
            or dataclasses.is_dataclass(getattr(value, f.name))
        }
        return dataclasses.replace(value, **changes)
    return value
