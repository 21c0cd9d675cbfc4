"""The in-process Engine: tokenizer, scheduler and worker in one loop, no network.

`generate()` runs a list of prompts to completion with continuous batching; `stream()` yields
one answer's text as it is produced. `add_request`/`step`/`abort` drive it by hand.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvmesh.engine.prompts import PromptInput, to_token_ids
from services.engine_worker.worker import Worker
from services.scheduler.scheduler import Scheduler
from services.scheduler.tier_loads import TierPolicy
from services.tokenizer.detokenizer import IncrementalDetokenizer
from shared.block_hash import hash_full_blocks
from shared.config import EngineConfig
from shared.errors import KvmeshError, Reason
from shared.outputs import RequestOutput, finish_reason_label
from shared.sampling import SamplingParams
from shared.step import TokenLogprobs
from shared.text_tokenizer import TextTokenizer, load_tokenizer


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # positions 1..
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    loaded_tokens: int = 0  # prompt tokens loaded from a KV tier
    error: str | None = None  # the reason, when a step could not compute it (it then has none)

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.token_ids),
            "cached_tokens": self.cached_tokens,
        }


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.worker = Worker(self.config)
        self.tokenizer: TextTokenizer | None = load_tokenizer(self.worker.model_path)
        arch = self.worker.architecture
        tiers = self.config.kv_tiers
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.config.cache,
            self.worker.num_kv_blocks,
            self.worker.max_model_len,
            arch.eos_token_ids,
            TierPolicy(tiers.tiers, tiers.write, tiers.load_min_tokens),
            self.worker.window_pool,
        )
        self._ids = itertools.count()

    @property
    def manifest(self) -> dict:
        return self.worker.manifest.to_dict()

    def add_request(
        self,
        prompt: PromptInput,
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        group_id: str = "",
    ) -> str:
        """group_id: the n completions of one prompt share it (and the prompt's K/V)."""
        return self._submit(prompt, sampling, request_id, priority, group_id)[0]

    def _submit(
        self,
        prompt: PromptInput,
        sampling: SamplingParams,
        request_id: str | None,
        priority: int,
        group_id: str = "",
    ) -> tuple[str, list[int]]:
        sampling.validate()  # this engine is the edge: its caller is the user
        token_ids = to_token_ids(prompt, self.tokenizer, self.worker.architecture.vocab_size)
        if sampling.response_format is not None:  # compiled (and checked) before it queues
            self.worker.grammars().matcher(sampling.response_format)
        request_id = request_id or f"req-{next(self._ids)}"
        tier_blocks = 0
        if self.config.kv_tiers.enabled:  # how much of it the tiers could give
            hashes = hash_full_blocks(token_ids, self.config.cache.block_size)
            tier_blocks = self.worker.kv_transfer.leading(hashes)
        self.scheduler.add_request(
            request_id,
            token_ids,
            sampling,
            priority,
            group_id=group_id,
            num_tier_blocks=tier_blocks,
        )
        return request_id, token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort(request_id)

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        started = time.perf_counter()
        result = self.worker.execute(plan)
        self.worker.kv_transfer.observe_step(plan.num_prefill_tokens, time.perf_counter() - started)
        return self.scheduler.update(plan, result)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self, prompts: Sequence[PromptInput], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """All prompts submitted at once; results in input order."""
        params = (
            [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        )
        completions: dict[str, Completion] = {}
        order: list[str] = []
        try:
            for prompt, sampling_params in zip(prompts, params, strict=True):
                request_id, token_ids = self._submit(prompt, sampling_params, None, 0)
                completions[request_id] = Completion(request_id, token_ids)
                order.append(request_id)
        except Exception:
            for request_id in order:  # all or nothing: no request is left queued unowned
                self.abort(request_id)
            raise
        while self.has_unfinished():
            for output in self.step():
                completion = completions[output.request_id]
                completion.token_ids += output.new_token_ids
                completion.logprobs += output.logprobs
                completion.prompt_logprobs += output.prompt_logprobs
                if output.finish_reason is not None:
                    completion.finish_reason = finish_reason_label(output.finish_reason)
                    completion.cached_tokens = output.num_cached_tokens
                    completion.loaded_tokens = output.num_loaded_tokens
                if output.failure is not None:
                    completion.error = output.failure.reason
        for request_id in order:
            completion = completions[request_id]
            if self.tokenizer is not None:
                completion.text = self.tokenizer.decode(completion.token_ids)
        return [completions[r] for r in order]

    def stream(self, prompt: PromptInput, sampling: SamplingParams) -> Iterator[str]:
        """Text deltas of one answer as tokens arrive; aborts the request if the caller stops.

        It drives the engine itself: use it alone, not beside `generate` or a hand-run `step`
        loop, whose outputs it would consume."""
        if self.tokenizer is None:
            raise KvmeshError(
                Reason.TOKENIZER_UNAVAILABLE,
                "streaming text needs a tokenizer; this model ships none",
            )
        request_id = self.add_request(prompt, sampling)
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        finished = False
        try:
            while not finished:
                for output in self.step():
                    if output.request_id != request_id:
                        continue
                    if output.failure is not None:
                        finished = True
                        reason = Reason(output.failure.reason)
                        raise KvmeshError(reason, "the engine could not compute this request")
                    if text := detokenizer.push(output.new_token_ids):
                        yield text
                    finished = output.finished
            if tail := detokenizer.flush():
                yield tail
        finally:
            if not finished:
                self.abort(request_id)
