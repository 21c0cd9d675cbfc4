"""The prefill/decode split flags every scheduler takes (`kvmesh up` forwards them)."""

from __future__ import annotations

import argparse

from shared.config import KV_LOAD_FAILURE_POLICIES, SERVING_ROLES, HandoverConfig
from shared.flag_env import env_default, env_float


def add_handover_flags(parser: argparse.ArgumentParser, per_pair: bool = True) -> None:
    """`per_pair` off: only the flags a launcher forwards to every scheduler alike (it gives
    each pair its role itself)."""
    group = parser.add_argument_group("prefill/decode split (docs/guides/prefill-decode.md)")
    if per_pair:
        _add_pair_flags(group)
    group.add_argument(
        "--handover-lease-s",
        type=float,
        default=env_float("handover-lease-s", 30.0),
        help="prefill role: how long a prefilled request's blocks wait for its decode pair",
    )
    group.add_argument(
        "--handover-timeout-s",
        type=float,
        default=env_float("handover-timeout-s", 10.0),
        help="decode role: the bound on pulling a request's blocks from its prefill worker",
    )
    group.add_argument(
        "--kv-load-failure",
        default=env_default("kv-load-failure", "recompute"),
        choices=list(KV_LOAD_FAILURE_POLICIES),
        help="a handover whose blocks did not all arrive: recompute the rest, or fail the "
        "request with KV_HANDOVER_FAILED",
    )


def _add_pair_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--role",
        default=env_default("role", "mixed"),
        choices=list(SERVING_ROLES),
        help="mixed: prefill and decode; prefill: prompts only, each handed over to a decode "
        "pair after its first token; decode: takes handovers (and prompts too short to split)",
    )
    group.add_argument(
        "--worker-advertise",
        default=env_default("worker-advertise", ""),
        help="the address other workers pull this pair's handed-over blocks from "
        "(default: --worker)",
    )


def handover_flag_args(args: argparse.Namespace) -> list[str]:
    """The flags `add_handover_flags(per_pair=False)` parsed, back as arguments."""
    forwarded = ["--handover-lease-s", str(args.handover_lease_s)]
    forwarded += ["--handover-timeout-s", str(args.handover_timeout_s)]
    return [*forwarded, "--kv-load-failure", args.kv_load_failure]


def handover_config(args: argparse.Namespace, worker_address: str) -> HandoverConfig:
    return HandoverConfig(
        role=args.role,
        worker_advertise=args.worker_advertise or worker_address,
        lease_s=args.handover_lease_s,
        pull_timeout_s=args.handover_timeout_s,
        load_failure=args.kv_load_failure,
    )
