"""The KV tier flags every engine-worker takes (`kvmesh up` forwards them), and their config."""

from __future__ import annotations

import argparse

from shared.config import KV_TIERS, KV_WRITE_POLICIES, KVTierConfig, parse_bytes
from shared.flag_env import env_default, env_int


def _env(flag: str, default: str) -> str:
    return env_default(flag, default) or default


def add_kv_tier_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV tiers (services/engine_worker/kv_tiers)")
    group.add_argument(
        "--kv-tiers",
        default=_env("kv-tiers", ""),
        help=f"comma-separated, of {', '.join(KV_TIERS)}: where KV blocks go below the pool "
        "and are loaded back from (another worker's, or before a restart); default none",
    )
    group.add_argument(
        "--kv-redis",
        default=_env("kv-redis", ""),
        help="the redis tier's server (default: the mesh's Redis, under `kvmesh up`)",
    )
    group.add_argument(
        "--kv-disk-dir",
        default=_env("kv-disk-dir", ""),
        help="the disk tier's folder (default $KVMESH_CACHE_DIR/kv-blocks)",
    )
    for tier, default in (("host", "4GiB"), ("disk", "20GiB"), ("redis", "2GiB")):
        group.add_argument(
            f"--kv-{tier}-bytes",
            default=_env(f"kv-{tier}-bytes", default),
            help=f"the {tier} tier's budget; least recently used blocks leave first",
        )
    group.add_argument(
        "--kv-write",
        default=_env("kv-write", "through"),
        choices=list(KV_WRITE_POLICIES),
        help="through: a prefix block goes down as it fills (found by other workers and after "
        "a restart); back: only when the pool evicts it",
    )
    group.add_argument(
        "--kv-load-min-tokens",
        type=int,
        default=env_int("kv-load-min-tokens", 256),
        help="a tier hit shorter than this is recomputed instead of loaded",
    )


def kv_tier_config(args: argparse.Namespace) -> KVTierConfig:
    tiers = tuple(t.strip() for t in args.kv_tiers.split(",") if t.strip())
    return KVTierConfig(
        tiers=tiers,
        host_bytes=parse_bytes(args.kv_host_bytes),
        disk_dir=args.kv_disk_dir,
        disk_bytes=parse_bytes(args.kv_disk_bytes),
        redis_url=args.kv_redis,
        redis_bytes=parse_bytes(args.kv_redis_bytes),
        write=args.kv_write,
        load_min_tokens=args.kv_load_min_tokens,
    )


def kv_tier_flag_args(args: argparse.Namespace) -> list[str]:
    """The flags back as arguments, for a launcher to forward (--kv-redis only when given: the
    launcher names its own Redis otherwise)."""
    forwarded = ["--kv-tiers", args.kv_tiers, "--kv-write", args.kv_write]
    forwarded += ["--kv-load-min-tokens", str(args.kv_load_min_tokens)]
    for tier in ("host", "disk", "redis"):
        forwarded += [f"--kv-{tier}-bytes", getattr(args, f"kv_{tier}_bytes")]
    forwarded += ["--kv-disk-dir", args.kv_disk_dir] if args.kv_disk_dir else []
    return forwarded + (["--kv-redis", args.kv_redis] if args.kv_redis else [])
