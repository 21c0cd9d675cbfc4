"""The engine worker: validate, load, prepare, allocate the KV pool, warm up; then run steps.

Order matters: every check that can refuse a model runs before any large allocation.
"""

from __future__ import annotations

import importlib
import os
import threading
import time

import torch

from services.engine_worker.artifacts.loader import artifact_files, open_artifact
from services.engine_worker.artifacts.weights import ModelWeights
from services.engine_worker.backends import BACKENDS, resolve_backend
from services.engine_worker.capacity import check_memory_fits
from services.engine_worker.grammar import GrammarCompiler
from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.manifest import ModelManifest
from services.engine_worker.runtime_facts import device_name, runtime_versions, tokenizer_digest
from services.engine_worker.step_failures import (
    FaultInjector,
    InjectedFault,
    failure_of,
    run_isolated,
)
from services.engine_worker.step_inputs import RequestState
from services.engine_worker.torch_backend.step_formats import StepFormats, dtype_name
from services.engine_worker.torch_backend.weights import int4_source
from shared.config import EngineConfig
from shared.errors import KvmeshError, ModelValidationError, Reason
from shared.model_entry import ModelEntry, WarmupFixture, is_entry, read_entry, sha256_file
from shared.model_paths import resolve_model_path
from shared.sampling import SamplingParams
from shared.step import FailedRequest, NewRequestPlan, SampledToken, StepPlan, StepResult
from shared.text_tokenizer import load_tokenizer


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.entry: ModelEntry | None = None
        if is_entry(self.model_path):  # a repository version: its digests first, then its bytes
            self.entry = read_entry(self.model_path)
            self.entry.verify()
            self.model_path = self.entry.artifact_path
        artifact = open_artifact(self.model_path)
        artifact.validate()
        self.architecture = arch = artifact.architecture
        self.max_model_len = self._max_model_len(config, arch.max_position_embeddings)
        self.backend = resolve_backend(config.backend)
        formats = StepFormats.resolve(config, self.backend, artifact.quantization)
        kv_shape = KVCacheShape.from_budget(
            arch, config.cache.block_size, config.cache.kv_memory_bytes, formats.kv_cache
        )
        load_dtype = torch.float32 if formats.weights == "packed" else formats.activations
        # Weights (packed ones come from a float32 copy, the peak), the KV budget and a step's
        # workspace: checked before any is allocated, not found short while others serve.
        limits = config.scheduler
        check_memory_fits(
            {
                "weights": arch.num_parameters * load_dtype.itemsize,
                "KV cache": kv_shape.num_bytes(formats.kv_cache.itemsize),
                "step workspace": arch.step_workspace_bytes(
                    limits.max_num_batched_tokens,
                    limits.max_sampled_rows,
                    formats.activations.itemsize,
                ),
            },
            self.backend,
        )
        weights = ModelWeights.build(arch, artifact.load, load_dtype)
        num_parameters, runner_module = weights.num_parameters, BACKENDS[self.backend]
        packed = formats.weights == "packed"  # torch only: a Q4 file's 4-bit groups if fast
        int4 = {"int4": int4_source(artifact, config.quantize)} if packed else {}
        self.runner = importlib.import_module(runner_module).Runner(
            arch,
            weights,
            kv_shape,
            self.max_model_len,
            formats.activations,
            formats.runner_config(config),
            **int4,
        )
        del weights  # the runner keeps what it needs, in its own format
        self.kv_shape = kv_shape
        load_seconds = time.perf_counter() - started
        self.requests: dict[str, RequestState] = {}
        self.faults: FaultInjector | None = None  # a test hook; off unless a flag sets it
        self._rng = torch.Generator().manual_seed(0)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # built once, from whichever thread asks first
        warmup_started = time.perf_counter()
        self.warm_up()
        entry = self.entry
        for index, fixture in enumerate(entry.fixtures if entry else ()):
            self._check_fixture(index, fixture)
        digests = self._artifact_digests()
        self.manifest = ModelManifest(
            model_name=entry.name if entry else os.path.basename(self.model_path.rstrip("/")),
            artifact_path=self.model_path,
            artifact_sha256=digests,
            architecture=arch.name,
            num_parameters=num_parameters,
            dtype=config.dtype,
            quantization=artifact.quantization,
            weights=formats.weights,
            weights_resident_bytes=self.runner.weights_resident_bytes,
            compiled=getattr(self.runner, "compiled", None) is not None,
            backend=self.backend,
            max_model_len=self.max_model_len,
            kv_cache_dtype=dtype_name(formats.kv_cache),
            kv_bytes_per_token=arch.kv_bytes_per_token(formats.kv_cache.itemsize),
            kv_block_size=kv_shape.block_size,
            kv_blocks=kv_shape.num_blocks,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            load_seconds=round(load_seconds, 3),
            warmup_seconds=round(time.perf_counter() - warmup_started, 3),
            repository_version=entry.version if entry else "",
            aliases=entry.aliases if entry else (),
            default_sampling=dict(entry.default_sampling) if entry else None,
            runtime=runtime_versions(self.backend),
            device=device_name(self.backend),
            threads=torch.get_num_threads(),
            tokenizer_digest=tokenizer_digest(digests),
        )

    def _artifact_digests(self) -> dict[str, str]:
        if self.entry is not None:  # verified a moment ago: no second pass over the bytes
            directory = self.entry.directory
            return {os.path.join(directory, f): d for f, d in self.entry.sha256.items()}
        return {f: sha256_file(f) for f in artifact_files(self.model_path)}

    @staticmethod
    def _max_model_len(config: EngineConfig, model_len: int) -> int:
        if config.max_model_len is None:
            return model_len
        if config.max_model_len > model_len:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"max_model_len {config.max_model_len} exceeds the model's context "
                f"length {model_len}",
            )
        return config.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_shape.num_blocks

    def warm_up(self) -> None:
        """One mixed prefill + decode step on scratch blocks, so the first request pays no
        first-call costs. Nothing it writes is ever read: no block table points at it."""
        block = self.kv_shape.block_size
        tokens = list(range(min(block + 1, self.architecture.vocab_size)))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        prefill = RequestState("warmup-prefill", tokens, [0, 1], 0, params, len(tokens))
        decode = RequestState("warmup-decode", tokens[:2], [0], 1, params, 1)
        self._run_scratch([(decode, 1), (prefill, len(tokens))])
        # And a decode-only step: the compiled step has a graph for those too.
        decode = RequestState("warmup-decode-alone", tokens[:2], [0], 1, params, 1)
        self._run_scratch([(decode, 1)])

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens (EOS included) on scratch blocks: how warm-up fixtures are checked."""
        block = self.kv_shape.block_size
        num_blocks = -(-(len(prompt_ids) + max_tokens) // block)
        if not prompt_ids or num_blocks > self.kv_shape.num_blocks:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, "a fixture needs a prompt that fits the KV cache"
            )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        state = RequestState(
            "fixture", list(prompt_ids), list(range(num_blocks)), 0, params, len(prompt_ids)
        )
        scheduled = len(prompt_ids)
        for _ in range(max_tokens):
            self._run_scratch([(state, scheduled)])
            scheduled = 1
        return state.token_ids[len(prompt_ids) :]

    def prompt_log_softmax(self, prompt_ids: list[int]) -> torch.Tensor:
        """(len - 1, vocab): the next-token log-distribution after each prefix of the prompt
        (torch backend), on scratch blocks, before any request runs: for quality checks."""
        block = self.kv_shape.block_size
        num_blocks = -(-len(prompt_ids) // block)
        if len(prompt_ids) < 2 or num_blocks > self.kv_shape.num_blocks:
            raise KvmeshError(Reason.INVALID_ARGUMENT, "a text that fits the KV cache is needed")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        state = RequestState(
            "score", list(prompt_ids), list(range(num_blocks)), 0, params, len(prompt_ids)
        )
        return self.runner.prompt_log_softmax(state)

    def _check_fixture(self, index: int, fixture: WarmupFixture) -> None:
        found = self.greedy(list(fixture.prompt_ids), len(fixture.expected_ids))
        if tuple(found) != fixture.expected_ids:
            assert self.entry is not None
            raise ModelValidationError(
                self.entry.directory,
                f"{self.entry.label}: warm-up fixture {index} output differs; the model "
                "does not serve",
                expected=list(fixture.expected_ids),
                found=found,
            )

    def grammars(self) -> GrammarCompiler:
        """Built on first use: loads the tokenizer llguidance needs (a fraction of a second)."""
        with self._grammars_lock:
            return self._load_grammars()

    def _load_grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            tokenizer = load_tokenizer(self.model_path)
            if tokenizer is None:
                raise KvmeshError(
                    Reason.TOKENIZER_UNAVAILABLE, "response formats need the model's tokenizer"
                )
            arch = self.architecture
            self._grammars = GrammarCompiler(tokenizer, arch.vocab_size, arch.eos_token_ids)
        return self._grammars

    def execute(self, plan: StepPlan) -> StepResult:
        """One step. It never raises: a request whose computation raises fails alone, and an
        error outside any one request (a plan naming a request this worker never saw) fails
        the step's requests, each with its own failure, instead of breaking the stream."""
        try:
            return self._execute(plan)
        except Exception as error:  # reported per request, logged with its cause
            request_ids = [r.request_id for r in plan.new_requests]
            request_ids += [r.request_id for r in plan.running_requests]
            for request_id in request_ids:
                self.requests.pop(request_id, None)
            return StepResult(plan.step_id, (), tuple(failure_of(r, error) for r in request_ids))

    def _execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        self.runner.copy_blocks(plan.block_copies)  # before anything writes to them
        scheduled: list[tuple[RequestState, int]] = []
        failed: list[FailedRequest] = []
        for new in plan.new_requests:
            try:
                state = self._admit(new)
            except Exception as error:  # this request fails, not the batch
                failed.append(failure_of(new.request_id, error))
                continue
            scheduled.append((state, new.num_scheduled_tokens))
        for running in plan.running_requests:
            state = self.requests[running.request_id]
            scheduled.append((state, state.apply(running)))
        sampled: list[SampledToken] = []
        if scheduled:
            sampled, failed_running = run_isolated(self._run, scheduled)
            failed += failed_running
        for failure in failed:
            self.requests.pop(failure.request_id, None)
        return StepResult(plan.step_id, tuple(sampled), tuple(failed))

    def _admit(self, new: NewRequestPlan) -> RequestState:
        state = RequestState.from_plan(new)
        if new.sampling.response_format is not None:
            state.matcher = self.grammars().matcher(new.sampling.response_format)
            state.matcher.consume_tokens(state.token_ids[new.prompt_len :])  # recompute
        self.requests[new.request_id] = state
        return state

    def _run_scratch(self, scheduled: list[tuple[RequestState, int]]) -> None:
        """Warm-up and fixtures: a failure there refuses the model (the log has the cause)."""
        _, failed = self._run(scheduled)
        if failed:
            raise RuntimeError(f"a scratch step failed: {failed[0].error_type}")

    def _run(
        self, scheduled: list[tuple[RequestState, int]]
    ) -> tuple[list[SampledToken], list[FailedRequest]]:
        states, outcomes = self.runner.step(scheduled, self._rng)
        for state, num_new in scheduled:
            state.num_computed_tokens += num_new
        sampled: list[SampledToken] = []
        failed: list[FailedRequest] = []
        for state, outcome in zip(states, outcomes, strict=True):
            if isinstance(outcome, SampledToken) and self.faults is not None:
                try:
                    self.faults.check(state.token_ids[: state.prompt_len], state.num_output_tokens)
                except InjectedFault as error:
                    outcome = failure_of(state.request_id, error)
            if isinstance(outcome, FailedRequest):
                failed.append(outcome)
                continue
            state.settle_drafts(outcome.num_accepted_drafts, self.kv_shape.block_size)
            state.token_ids.append(outcome.token_id)
            sampled.append(outcome)
        return sampled, failed
