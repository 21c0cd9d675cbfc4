"""The cupy backend's step: host arrays -> GPU forward (a CUDA graph for decode-only steps)
-> sampling.

Sampling runs on the GPU with the forward (inside the graph): each row's token and its logprob,
one copy back for the whole step. Rows with penalties, a logit bias, a response format or
top-N logprobs (device_sampling.py) have their logits copied to the host and go through the
shared torch sampler, one (vocab,) copy each.
"""

from __future__ import annotations

import math
import os
from typing import Any

import cupy
import numpy
import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.weights import ModelWeights
from services.engine_worker.cupy_backend.batch import GpuBatch, build_gpu_batch
from services.engine_worker.cupy_backend.cublas_gemm import WORKSPACE_BYTES, CublasGemm
from services.engine_worker.cupy_backend.device_sampling import DeviceRows, row_parameters
from services.engine_worker.cupy_backend.graphs import DecodeGraphs, buckets_up_to
from services.engine_worker.cupy_backend.kernels.library import DTYPES
from services.engine_worker.cupy_backend.kernels.paged_decode_attention import check_shape
from services.engine_worker.cupy_backend.kv_pool import GpuKVCache
from services.engine_worker.cupy_backend.model import CupyCausalLM, DeviceBatch
from services.engine_worker.cupy_backend.packed_inputs import PackedInputs
from services.engine_worker.cupy_backend.step_timing import StepTiming
from services.engine_worker.cupy_backend.workspace import (
    StepLimits,
    Workspace,
    sampled_layout,
    workspace_bytes,
)
from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.persistent_batch import BlockTables
from services.engine_worker.sampler import sample
from services.engine_worker.step_failures import NonFiniteLogits, failure_of
from services.engine_worker.step_inputs import RequestState, unique_states
from services.engine_worker.verification import sample_and_verify
from shared.config import EngineConfig
from shared.step import FailedRequest, PromptLogprobs, SampledToken, TokenLogprobs

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cuda_graphs_enabled() -> bool:
    """KVMESH_CUDA_GRAPHS=0 runs every step eagerly (to compare, or to debug a kernel)."""
    return os.environ.get("KVMESH_CUDA_GRAPHS", "1") != "0"


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU: decode attention's grid is sized by it."""
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return int(properties["multiProcessorCount"])


def step_limits(config: EngineConfig) -> StepLimits:
    """What the worker states and the scheduler plans within (services/scheduler/step_limits.py)."""
    limits = config.scheduler
    return StepLimits(limits.max_num_batched_tokens, limits.max_sampled_rows, sm_count())


class Runner:
    # The worker's persistent block tables (persistent_batch.py); set by the worker once built.
    block_tables: BlockTables | None = None
    # Prompt logprobs need logits at every prefill row, past the workspace's sampled rows:
    # the worker refuses them on this backend (the torch backend computes them).
    scores_prompts = False

    @staticmethod
    def take_prompt_scores() -> tuple[PromptLogprobs, ...]:
        return ()

    def __init__(
        self,
        arch: ModelArchitecture,
        weights: ModelWeights,
        kv_shape: KVCacheShape,
        max_model_len: int,
        dtype: torch.dtype,
        config: EngineConfig,
    ) -> None:
        self.spec = DTYPES[_DTYPE_NAMES[dtype]]
        check_shape(
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            kv_shape.block_size,
            self.spec.itemsize,
        )
        self.arch = arch
        self.block_size = kv_shape.block_size
        self.weights_resident_bytes = weights.resident_bytes  # copied to the GPU as they are
        self.stream = cupy.cuda.Stream(non_blocking=True)
        limits = step_limits(config)
        with self.stream:
            self.gemm = CublasGemm(self.stream)
            self.model = CupyCausalLM(arch, weights, max_model_len, self.spec, self.gemm)
            self.cache = GpuKVCache(kv_shape, self.spec, self.stream)
            self.workspace = Workspace(arch, self.spec, limits)
        # Where the step's sampled tokens and logprobs land on the host (workspace.sampled).
        self._pinned = cupy.cuda.alloc_pinned_memory(int(self.workspace.sampled.nbytes))
        self.sampled_host = numpy.frombuffer(
            self._pinned, numpy.int32, int(self.workspace.sampled.shape[0])
        )
        self.timing: StepTiming | None = None  # bench-gpu sets one: GPU ms per step
        self.buckets = buckets_up_to(limits.max_samples)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs_enabled():
            self.graphs = DecodeGraphs(
                self.model, self.cache, self.workspace, max_model_len, self.stream, self.buckets
            )
            self.graphs.capture()

    @staticmethod
    def step_memory_bytes(
        arch: ModelArchitecture, dtype: torch.dtype, config: EngineConfig, max_model_len: int
    ) -> int:
        """What a runner allocates besides weights and KV pool, known before it loads: the
        workspace, cuBLAS's workspace, the graphs' input buffers and the RoPE tables."""
        limits = step_limits(config)
        graph_inputs = PackedInputs.num_bytes(
            buckets_up_to(limits.max_samples)[-1], -(-max_model_len // config.cache.block_size)
        )
        rope_tables = 2 * max_model_len * (arch.head_dim // 2) * 4
        spec = DTYPES[_DTYPE_NAMES[dtype]]
        return workspace_bytes(arch, spec, limits) + WORKSPACE_BYTES + graph_inputs + rope_tables

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.num_bytes

    @property
    def cuda_graphs(self) -> dict[str, str]:
        """For the manifest: each decode batch size, "graph" or why it runs eagerly."""
        if self.graphs is None:
            return {str(size): "off (KVMESH_CUDA_GRAPHS=0)" for size in self.buckets}
        return self.graphs.report()

    @property
    def kv_pool(self) -> Any:
        """The pool blocks are read from and loaded into (read_block, write_block)."""
        return self.cache

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        with self.stream:  # ordered before the step's kernels on the same stream
            self.cache.copy_blocks(pairs)

    def step(
        self, scheduled: list[tuple[RequestState, int]], rng: torch.Generator
    ) -> tuple[tuple[RequestState, ...], list[SampledToken | FailedRequest]]:
        tables = None if self.block_tables is None else self.block_tables.table
        batch = build_gpu_batch(scheduled, self.block_size, tables=tables)
        drafts = any(state.num_drafts for state in batch.sampling_states)
        # Rows with drafts are verified on the host, their logits as the model gave them.
        sampling = row_parameters(
            batch.sampling_states, rng, self.arch.vocab_size, use_device=not drafts
        )
        timing = self.timing
        if timing is not None:
            timing.start(self.stream)
        logits = None
        if self.graphs is not None and batch.decode_only:
            logits = self.graphs.run(batch, sampling)
        replayed = logits is not None
        if logits is None:
            logits = self._eager(batch, sampling)
        if timing is not None:
            timing.stop(self.stream, replayed)
        outcomes = self._sample(logits, batch, sampling, rng, drafts)  # waits for the results
        if timing is not None:
            timing.read()
        return unique_states(batch.sampling_states), outcomes

    def _eager(self, batch: GpuBatch, sampling: DeviceRows) -> Any:
        with self.stream:
            self.workspace.check_fits(batch.num_tokens, len(batch.sampling_states))
            device = DeviceBatch.upload(batch, sampling)
            return self.model.forward_and_sample(device, self.cache, self.workspace)

    def _sampled_results(self, rows: int, with_top: bool) -> tuple[Any, Any, Any, Any]:
        """The step's sampled tokens, logprobs and top logprobs (sampled_layout's views of
        pinned memory): one copy, one wait; the top ones only when a row asked for them."""
        samples = self.workspace.limits.max_samples
        words = self.sampled_host.shape[0] if with_top else 2 * samples
        self.workspace.sampled[:words].get(
            stream=self.stream, out=self.sampled_host[:words], blocking=False
        )
        self.stream.synchronize()
        return sampled_layout(self.sampled_host, samples, rows)

    def _sample(
        self,
        logits: Any,
        batch: GpuBatch,
        sampling: DeviceRows,
        rng: torch.Generator,
        drafts: bool,
    ) -> list[SampledToken | FailedRequest]:
        states = batch.sampling_states
        if drafts:  # verification runs on the host
            with self.stream:
                host_logits = torch.from_numpy(cupy.asnumpy(logits))
            return sample_and_verify(host_logits, states, rng)
        fast = [row for row, device in enumerate(sampling.on_device) if device]
        slow = [row for row, device in enumerate(sampling.on_device) if not device]
        results: list[SampledToken | FailedRequest | None] = [None] * len(states)
        with self.stream:
            if fast:
                with_top = any(states[row].sampling.logprobs for row in fast)
                tokens, logprobs, top_ids, top_logprobs = self._sampled_results(
                    len(states), with_top
                )
                for row in fast:
                    token, logprob, state = int(tokens[row]), float(logprobs[row]), states[row]
                    if not math.isfinite(logprob):  # the kernel's sign of a NaN or inf logit
                        error = NonFiniteLogits("non-finite logits")
                        results[row] = failure_of(state.request_id, error)
                        continue
                    wants = state.sampling.logprobs
                    count = wants or 0
                    top = zip(
                        top_ids[row, :count].tolist(),
                        top_logprobs[row, :count].tolist(),
                        strict=True,
                    )
                    results[row] = SampledToken(
                        state.request_id,
                        token,
                        None if wants is None else TokenLogprobs(token, logprob, tuple(top)),
                    )
            if slow:
                host = torch.from_numpy(cupy.asnumpy(logits[cupy.asarray(slow)]))
                for row, outcome in zip(
                    slow, sample(host, [states[r] for r in slow], rng), strict=True
                ):
                    results[row] = outcome
        return [outcome for outcome in results if outcome is not None]
