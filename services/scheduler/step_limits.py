"""The step limits a scheduler and its engine-worker agree on before the first step.

The worker sizes its step buffers (the cupy backend's workspace and graphs, the torch
backend's memory-fit estimate) for a token budget and a number of sampled rows, and states
them in its ModelInfo. A scheduler whose own flags would plan a larger step refuses to start,
naming both values, rather than failing its first long step deep inside the worker.
"""

from __future__ import annotations

from shared.config import SchedulerConfig
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2


def check_step_limits(
    config: SchedulerConfig, model: common_pb2.ModelInfo, worker_address: str
) -> None:
    """Raises INVALID_ARGUMENT when this scheduler would plan past what the worker holds.
    A worker that states no limits (0: one from before they were stated) is not checked."""
    problems = []
    if model.max_step_tokens and config.max_num_batched_tokens > model.max_step_tokens:
        problems.append(
            f"--max-batched-tokens {config.max_num_batched_tokens} is above the "
            f"{model.max_step_tokens} tokens"
        )
    if model.max_step_sampled_rows and config.max_sampled_rows > model.max_step_sampled_rows:
        problems.append(
            f"{config.max_sampled_rows} sampled rows a step (--max-num-seqs and "
            f"--speculative) are above the {model.max_step_sampled_rows} rows"
        )
    if problems:
        raise KvmeshError(
            Reason.INVALID_ARGUMENT,
            f"this scheduler's {' and '.join(problems)} that engine-worker {worker_address}'s "
            "step buffers were sized for: give both processes the same step limit flags",
        )
