"""The scheduler's settings, each declared once (shared/runtime/settings.py), and the configs
built from them: batching, and the pair's part in the prefill/decode split. The step limits it
shares with its engine-worker are declared in shared/step_limits.py."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from shared.config import KV_LOAD_FAILURE_POLICIES, SERVING_ROLES, HandoverConfig, SchedulerConfig
from shared.runtime.service import service_parser
from shared.runtime.settings import (
    SCHEDULER,
    Setting,
    decimal,
    redis_url,
    whole,
)
from shared.step_limits import STEP_LIMIT_SETTINGS, step_limit_config

DEFAULT_PORT = 50071
_DESCRIPTION = "queue and batch requests for one engine-worker"

SERVICE_SETTINGS = (
    Setting("worker", "127.0.0.1:50061", "engine-worker address"),
    Setting(
        "max-waiting",
        1024,
        "queued requests beyond this are refused with OVERLOADED",
        whole(1),
        takers=(SCHEDULER,),
    ),
    Setting(
        "redis",
        None,
        "publish load and prefix-cache contents here, e.g. redis://host:6379/0",
        redis_url,
    ),
    Setting(
        "advertise",
        None,
        "the address gateways know this scheduler by, which names its Redis entries "
        "(default: --host:--port)",
    ),
)

_BATCHING = "batching"
_BATCH: dict[str, Any] = dict(group=_BATCHING, takers=(SCHEDULER,))

BATCHING_SETTINGS = (
    Setting(
        "chunk-size",
        SchedulerConfig.prefill_chunk_size,
        "prefill chunk size; 0 turns chunked prefill off",
        whole(0),
        per_model=True,
        **_BATCH,
    ),
    Setting("no-prefix-caching", False, "turn automatic prefix caching off", switch=True, **_BATCH),
    Setting(
        "no-fair-prefill-first",
        False,
        "run a below-share tenant's prefill beside the running decodes, not before them",
        switch=True,
        **_BATCH,
    ),
    Setting(
        "plan-ahead",
        SchedulerConfig.plan_ahead,
        "plan each step while the worker computes the one before (auto: on when the "
        "worker computes on a GPU; lock-step with speculative decoding)",
        choices=("auto", "on", "off"),
        **_BATCH,
    ),
    Setting(
        "stream-interval",
        SchedulerConfig.stream_interval,
        "send a request's tokens to its caller every N tokens (the first and the last at "
        "once): fewer messages through the mesh per token, burstier streams; at any N, tokens "
        "a gateway has not relayed yet join the next delta",
        whole(1),
        **_BATCH,
    ),
)

_SPLIT = "prefill/decode split (docs/guides/prefill-decode.md)"
_HANDOVER: dict[str, Any] = dict(group=_SPLIT, takers=(SCHEDULER,))

HANDOVER_SETTINGS = (
    Setting(  # per pair: the launcher gives each its role
        "role",
        HandoverConfig.role,
        "mixed: prefill and decode; prefill: prompts only, each handed over to a decode "
        "pair after its first token; decode: takes handovers (and prompts too short to split)",
        choices=SERVING_ROLES,
        group=_SPLIT,
    ),
    Setting(
        "worker-advertise",
        HandoverConfig.worker_advertise,
        "the address other workers pull this pair's handed-over blocks from (default: --worker)",
        group=_SPLIT,
    ),
    Setting(
        "handover-lease-s",
        HandoverConfig.lease_s,
        "prefill role: how long a prefilled request's blocks wait for its decode pair",
        decimal(0.001),
        **_HANDOVER,
    ),
    Setting(
        "handover-timeout-s",
        HandoverConfig.pull_timeout_s,
        "decode role: the bound on pulling a request's blocks from its prefill worker",
        decimal(0.001),
        **_HANDOVER,
    ),
    Setting(
        "kv-load-failure",
        HandoverConfig.load_failure,
        "a handover whose blocks did not all arrive: recompute the rest, or fail the "
        "request with KV_HANDOVER_FAILED",
        choices=KV_LOAD_FAILURE_POLICIES,
        **_HANDOVER,
    ),
)

SETTINGS = (*SERVICE_SETTINGS, *STEP_LIMIT_SETTINGS, *BATCHING_SETTINGS, *HANDOVER_SETTINGS)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of this service (the configuration reference is generated from it)."""
    return service_parser("services.scheduler", _DESCRIPTION, DEFAULT_PORT, SETTINGS)


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return dataclasses.replace(
        step_limit_config(args),
        prefill_chunk_size=args.chunk_size or None,
        fair_prefill_first=not args.no_fair_prefill_first,
        plan_ahead=args.plan_ahead,
        stream_interval=args.stream_interval,
    )


def handover_config(args: argparse.Namespace, worker_address: str) -> HandoverConfig:
    return HandoverConfig(
        role=args.role,
        worker_advertise=args.worker_advertise or worker_address,
        lease_s=args.handover_lease_s,
        pull_timeout_s=args.handover_timeout_s,
        load_failure=args.kv_load_failure,
    )
