"""The engine worker: validate, load, prepare, allocate the KV pool, warm up; then run steps.

Order matters: every check that can refuse a model runs before any large allocation.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from services.engine_worker import scratch_steps
from services.engine_worker.artifacts.loader import open_artifact
from services.engine_worker.backends import backend_for_model
from services.engine_worker.background_preparation import finish_pending
from services.engine_worker.capacity import check_worker_fits, served_context
from services.engine_worker.grammar import GrammarCompiler
from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.kv_tiers.handover import Exports
from services.engine_worker.kv_tiers.transfer import BlockTransfer
from services.engine_worker.manifest import artifact_digests, combined_digest, describe
from services.engine_worker.persistent_batch import HeldRequests
from services.engine_worker.preparation import ready_runner
from services.engine_worker.prepared_artifact import step_limits_of
from services.engine_worker.preparing import fixture_blocks
from services.engine_worker.step_failures import (
    FaultInjector,
    InjectedFault,
    failure_of,
    run_isolated,
)
from services.engine_worker.step_formats import StepFormats
from services.engine_worker.step_inputs import RequestState
from services.engine_worker.step_runner import StepRunner
from services.engine_worker.torch_backend.saved_programs import StepCompileError
from services.engine_worker.window_blocks import WindowBlocks, window_requests
from shared.config import EngineConfig
from shared.errors import KvmeshError, ModelValidationError, Reason
from shared.model_entry import verified_source
from shared.model_paths import resolve_model_path
from shared.sliding_window import WindowPool
from shared.step import (
    FailedRequest,
    LoadFailure,
    NewRequestPlan,
    SampledToken,
    StepPlan,
    StepResult,
)
from shared.text_tokenizer import load_tokenizer


class Worker:
    """One model, loaded and checked, executing step plans.

    The constructor runs the preparation stages in order (verify, check the fit, load, warm up,
    check the fixtures, describe), each a method of its own.
    """

    def __init__(self, config: EngineConfig, background_preparation: bool = False) -> None:
        """`background_preparation`: a served worker, whose server runs `finish_preparation`
        between two steps once its child has stored the prepared artifact
        (background_preparation.py)."""
        started = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.faults: FaultInjector | None = None  # a test hook; off unless a flag sets it
        self._rng = torch.Generator().manual_seed(0)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # built once, from whichever thread asks first
        self.entry, self.model_path = verified_source(resolve_model_path(config.model))
        artifact = open_artifact(self.model_path)
        artifact.validate()
        self.architecture = arch = artifact.architecture
        self.max_model_len = served_context(config, arch.max_position_embeddings)
        self.backend = backend_for_model(config.backend, arch, self.model_path)
        formats = StepFormats.resolve(config, self.backend, artifact.quantization, arch.llama_layer)
        cache = config.cache
        self.kv_shape = KVCacheShape.from_budget(
            arch,
            cache.block_size,
            cache.kv_memory_bytes,
            formats.kv_cache,
            window_requests(config, self.backend),
        )
        self.window_blocks = WindowBlocks.of(self.kv_shape)
        self.scratch_start = self.kv_shape.num_blocks  # blocks from here: fixtures' only
        check_worker_fits(arch, formats, config, self.kv_shape, self.backend, self.max_model_len)
        self.requests = HeldRequests.for_context(self.max_model_len, config.cache.block_size)
        digests = artifact_digests(self.entry, self.model_path)
        # A repository version's fixtures were recorded with its compiled step: checked on it.
        background = background_preparation and not (self.entry and self.entry.fixtures)
        self.runner: StepRunner
        try:
            self.runner, num_parameters, self.preparation, self.pending_preparation = ready_runner(
                self, artifact, formats, combined_digest(digests), background
            )
        except StepCompileError as failed:
            raise failed.under(step_limits_of(config.scheduler)) from failed
        if self.pending_preparation is not None:  # its fixture's blocks, never the scheduler's
            self.scratch_start -= fixture_blocks(self.kv_shape.block_size)
        self.runner.block_tables = self.requests.tables
        self.requests.tables.window_blocks = self.window_blocks
        self.kv_transfer = BlockTransfer.open(
            config.kv_tiers, combined_digest(digests), formats.kv_cache, self.runner.kv_pool
        )
        self.handover_exports = Exports(self.requests, self.runner.kv_pool, config.cache.block_size)
        phases = self.preparation.phases
        fixtures_started = time.perf_counter()
        self._check_fixtures()
        phases["warmup"] += time.perf_counter() - fixtures_started
        self.manifest = describe(
            self.config,
            self.entry,
            self.model_path,
            self.architecture,
            self.runner,
            formats,
            backend=self.backend,
            max_model_len=self.max_model_len,
            kv_shape=dataclasses.replace(self.kv_shape, num_blocks=self.num_kv_blocks),
            window_pool=self.window_pool,
            quantization=artifact.quantization,
            num_parameters=num_parameters,
            digests=digests,
            # what the worker took before any step ran; warm-up: steps and fixtures
            load_seconds=time.perf_counter() - started - phases["compile"] - phases["warmup"],
            warmup_seconds=phases["compile"] + phases["warmup"],
            preparation=self.preparation.to_dict(),
        )

    def _check_fixtures(self) -> None:
        """A repository version's recorded greedy outputs, reproduced before it serves."""
        if self.entry is None or self.backend == "sim":  # its tokens are drawn, not computed
            return
        for index, fixture in enumerate(self.entry.fixtures):
            found = self.greedy(list(fixture.prompt_ids), len(fixture.expected_ids))
            if tuple(found) != fixture.expected_ids:
                raise ModelValidationError(
                    self.entry.directory,
                    f"{self.entry.label}: warm-up fixture {index} output differs; the model "
                    "does not serve",
                    expected=list(fixture.expected_ids),
                    found=found,
                )

    @property
    def num_kv_blocks(self) -> int:
        """The blocks the scheduler may use: all but those kept for fixtures while serving."""
        return self.scratch_start

    @property
    def window_pool(self) -> WindowPool | None:
        """The window blocks the scheduler may count: all but the null block and, while a
        fixture may run beside requests, what its steps hold."""
        shape = self.kv_shape
        if not shape.num_window_blocks:
            return None
        background = self.pending_preparation is not None
        reserve = fixture_blocks(shape.block_size) + 1 if background else 0
        return WindowPool(shape.window, shape.num_window_blocks - 1 - reserve)

    def finish_preparation(self) -> bool:
        """Between two steps, once the child has stored the prepared artifact: its programs
        serve from the next step and the manifest says so (background_preparation.py).
        False: the eager step serves on."""
        compiled = finish_pending(self)
        self.manifest = dataclasses.replace(self.manifest, preparation=self.preparation.to_dict())
        return compiled

    def warm_up(self) -> None:
        scratch_steps.warm_up(self)

    def greedy(self, prompt_ids: list[int], max_tokens: int, first_block: int = 0) -> list[int]:
        """Greedy tokens (EOS included) on scratch blocks: how warm-up fixtures are checked."""
        return scratch_steps.greedy(self, prompt_ids, max_tokens, first_block)

    def prompt_log_softmax(self, prompt_ids: list[int]) -> torch.Tensor:
        """(len - 1, vocab): the next-token log-distribution after each prefix of the prompt
        (torch backend), on scratch blocks, before any request runs: for quality checks."""
        return scratch_steps.prompt_log_softmax(self, prompt_ids)

    def grammars(self) -> GrammarCompiler:
        """Built on first use: loads the tokenizer llguidance needs (a fraction of a second)."""
        with self._grammars_lock:
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
                self.requests.drop_failed(request_id)
            return StepResult(plan.step_id, (), tuple(failure_of(r, error) for r in request_ids))

    def _execute(self, plan: StepPlan) -> StepResult:
        self.handover_exports.forget(plan.finished_request_ids)  # a lease's end among them
        self.kv_transfer.start_step(plan.block_writes)  # before this step may reuse them
        self.runner.copy_blocks(plan.block_copies)  # before anything writes to them
        scheduled: list[tuple[RequestState, int]] = []
        failed: list[FailedRequest] = []
        load_failures: list[LoadFailure] = []
        for new in plan.new_requests:
            try:
                state = self._admit(new)
                short = self.kv_transfer.load_into(new)
            except Exception as error:  # this request fails, not the batch
                failed.append(failure_of(new.request_id, error))
                continue
            if short is not None:  # it computes from there in a later step
                state.num_computed_tokens = short.num_computed_tokens
                load_failures.append(short)
                continue
            scheduled.append((state, new.num_scheduled_tokens))
        requests = self.requests
        for running in plan.running_requests:
            held = requests.get(running.request_id) or requests.running(running.request_id)
            if held is None:
                continue  # it failed in a step before; the scheduler planned it ahead
            requests.tables.extend(held, running.new_block_ids)
            scheduled.append((held, held.apply(running)))
        sampled: list[SampledToken] = []
        if scheduled:
            sampled, failed_running = run_isolated(self._run, scheduled)
            failed += failed_running
        for failure in failed:
            self.requests.drop_failed(failure.request_id)
        scores = self.runner.take_prompt_scores()
        return StepResult(plan.step_id, tuple(sampled), tuple(failed), tuple(load_failures), scores)

    def _admit(self, new: NewRequestPlan) -> RequestState:
        if new.sampling.prompt_logprobs is not None and not self.runner.scores_prompts:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT, f"the {self.backend} backend computes no prompt logprobs"
            )
        state = RequestState.from_plan(new)
        if new.sampling.response_format is not None:
            state.matcher = self.grammars().matcher(new.sampling.response_format)
            state.matcher.consume_tokens(state.token_ids[new.prompt_len :])  # recompute
        self.requests[new.request_id] = state
        return state

    def run_scratch(self, scheduled: list[tuple[RequestState, int]]) -> None:
        """Warm-up and fixtures: a failure there refuses the model (the log has the cause)."""
        _, failed = self._run(scheduled)
        if failed:
            raise RuntimeError(f"a scratch step failed: {failed[0].error_type}")

    def _run(
        self, scheduled: list[tuple[RequestState, int]]
    ) -> tuple[list[SampledToken], list[FailedRequest]]:
        if self.window_blocks is not None:
            self.window_blocks.cover(scheduled)
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
