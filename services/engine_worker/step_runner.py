"""The backend contract: what the worker asks of a backend's runner, as Protocols mypy checks
both backends' `Runner` against (the TYPE_CHECKING block below); backends.py finds a backend's
module by name, preparation.py builds its runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from services.engine_worker.artifacts.architecture import ModelArchitecture
from services.engine_worker.artifacts.weights import ModelWeights
from services.engine_worker.kv_cache import KVCacheShape
from services.engine_worker.persistent_batch import BlockTables
from services.engine_worker.step_inputs import RequestState
from shared.config import EngineConfig
from shared.step import FailedRequest, PromptLogprobs, SampledToken


class StepRunner(Protocol):
    """One loaded model on one device, stepping a batch against its KV pool."""

    # The worker's persistent block tables (persistent_batch.py), set once the worker built them.
    block_tables: BlockTables | None
    # Whether steps compute prompt logprobs (prompt_scores.py); if not, the worker refuses them.
    scores_prompts: bool
    weights_resident_bytes: int

    @property
    def kv_cache_bytes(self) -> int: ...

    @property
    def kv_pool(self) -> Any:
        """The pool KV blocks are read from and loaded into (read_block, write_block)."""

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: each (source, target) block, before the step's own writes."""

    def step(
        self, scheduled: list[tuple[RequestState, int]], rng: torch.Generator
    ) -> tuple[tuple[RequestState, ...], list[SampledToken | FailedRequest]]:
        """Each state's next `int` tokens through the model; the states that sampled and what
        each sampled or why it failed (never raises for one request's fault)."""

    def take_prompt_scores(self) -> tuple[PromptLogprobs, ...]:
        """Prompt logprobs the steps since the last call computed."""


class RunnerClass(Protocol):
    """A backend module's `Runner`: sized before it loads, then built from the weights."""

    def __call__(
        self,
        arch: ModelArchitecture,
        weights: ModelWeights,
        kv_shape: KVCacheShape,
        max_model_len: int,
        dtype: torch.dtype,
        config: EngineConfig,
    ) -> StepRunner: ...

    def step_memory_bytes(
        self, arch: ModelArchitecture, dtype: torch.dtype, config: EngineConfig, max_model_len: int
    ) -> int:
        """What a runner allocates besides weights and KV pool, known before it loads."""


if TYPE_CHECKING:  # both backends hold to the contract: mypy checks these assignments
    from services.engine_worker.cupy_backend.runner import Runner as CupyRunner
    from services.engine_worker.sim_backend.runner import Runner as SimRunner
    from services.engine_worker.torch_backend.runner import Runner as TorchRunner

    _BACKENDS: tuple[RunnerClass, ...] = (TorchRunner, CupyRunner, SimRunner)
