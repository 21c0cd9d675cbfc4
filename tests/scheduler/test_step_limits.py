"""A scheduler and its engine-worker agree on the largest step before the first one: the
worker states what its buffers hold, a scheduler that would plan more refuses with both values,
and a launcher forwards the same limits to both."""

from __future__ import annotations

import pytest

from kvmesh.cli import build_parser as kvmesh_parser
from kvmesh.mesh.config import MeshConfig
from kvmesh.mesh.settings import service_args
from services.engine_worker import config as worker_config
from services.scheduler import config as scheduler_config
from services.scheduler.step_limits import check_step_limits
from shared.config import SchedulerConfig, SpeculativeConfig
from shared.errors import KvmeshError, Reason
from shared.pb.kvmesh.v1 import common_pb2
from shared.runtime.settings import SCHEDULER, WORKER
from shared.step_limits import step_limit_args_of


def worker_info(tokens: int, rows: int) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(max_step_tokens=tokens, max_step_sampled_rows=rows)


def test_a_scheduler_within_the_workers_limits_starts() -> None:
    check_step_limits(SchedulerConfig(max_num_batched_tokens=2048), worker_info(2048, 128), "w")
    check_step_limits(SchedulerConfig(max_num_batched_tokens=512), worker_info(2048, 128), "w")


def test_a_larger_token_budget_is_refused_naming_both_values() -> None:
    with pytest.raises(KvmeshError) as refused:
        check_step_limits(
            SchedulerConfig(max_num_batched_tokens=4096), worker_info(2048, 128), "10.0.0.9:1"
        )
    assert refused.value.reason == Reason.INVALID_ARGUMENT
    message = str(refused.value)
    assert "--max-batched-tokens 4096" in message and "2048 tokens" in message
    assert "10.0.0.9:1" in message


def test_more_sampled_rows_than_the_worker_holds_are_refused() -> None:
    speculating = SchedulerConfig(max_num_seqs=128, speculative=SpeculativeConfig("ngram"))
    with pytest.raises(KvmeshError, match=r"512 sampled rows .* above the 128 rows"):
        check_step_limits(speculating, worker_info(2048, 128), "w")


def test_a_worker_that_states_no_limits_is_taken_at_its_word() -> None:
    check_step_limits(SchedulerConfig(max_num_batched_tokens=1 << 20), worker_info(0, 0), "w")


def test_the_worker_sizes_for_the_limits_its_schedulers_arguments_give() -> None:
    """`kvmesh up --max-batched-tokens 4096` reaches the worker's config, not a default: the
    launcher gives the worker the step limits of its scheduler's arguments."""
    up = ["up", "--max-batched-tokens", "4096", "--max-num-seqs", "16"]
    args = kvmesh_parser().parse_args(up)
    scheduler_argv = service_args(args, SCHEDULER)
    worker_argv = service_args(args, WORKER) + step_limit_args_of(scheduler_argv)
    worker = worker_config.build_parser().parse_args(worker_argv)
    worker_limits = worker_config.engine_config(worker).scheduler
    scheduler = scheduler_config.build_parser().parse_args(scheduler_argv)
    planned = scheduler_config.scheduler_config(scheduler)
    assert worker_limits.max_num_batched_tokens == planned.max_num_batched_tokens == 4096
    assert worker_limits.max_sampled_rows == planned.max_sampled_rows == 16
    info = worker_info(worker_limits.max_num_batched_tokens, worker_limits.max_sampled_rows)
    check_step_limits(planned, info, "w")


def test_a_mesh_gives_the_worker_the_limits_of_handwritten_scheduler_arguments() -> None:
    """MeshConfig(scheduler_args=[...]) or a repository entry's [serving] batching: the
    worker is sized for them, defaults where they say nothing."""
    worker = worker_config.build_parser()
    given = ["--role", "mixed", "--speculative", "ngram", "--num-speculative-tokens", "6"]
    mesh = MeshConfig(worker_args=["--kv-memory", "64MiB"], scheduler_args=given)
    limits = worker_config.engine_config(worker.parse_args(mesh.pair_worker_args)).scheduler
    assert limits.max_sampled_rows == min(2048, 128 * 7)
    assert limits.max_num_batched_tokens == 2048
