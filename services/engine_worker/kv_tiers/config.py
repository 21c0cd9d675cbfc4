"""The KV tier settings every engine-worker takes (`kvmesh up` forwards them, a repository
entry may set them for its pair), and the KVTierConfig built from them."""

from __future__ import annotations

import argparse
from typing import Any

from shared.config import KV_TIERS, KV_WRITE_POLICIES, KVTierConfig, format_bytes, parse_bytes
from shared.runtime.settings import UP, WORKER, Setting, choice_list, size, whole

_TIERS = "KV tiers (services/engine_worker/kv_tiers)"
_TIER: dict[str, Any] = dict(group=_TIERS, takers=(WORKER,), per_model=True)

KV_TIER_SETTINGS = (
    Setting(
        "kv-tiers",
        "",
        f"comma-separated, of {', '.join(KV_TIERS)}: where KV blocks go below the pool "
        "and are loaded back from (another worker's, or before a restart); default none",
        choice_list(KV_TIERS),
        **_TIER,
    ),
    Setting(
        "kv-redis",
        "",
        "the redis tier's server (default: the mesh's Redis, under `kvmesh up`)",
        group=_TIERS,
        takers=(UP,),  # forwarded only when given: the launcher names the mesh's otherwise
    ),
    Setting(
        "kv-disk-dir",
        "",
        "the disk tier's folder (default $KVMESH_CACHE_DIR/kv-blocks)",
        group=_TIERS,
        takers=(WORKER,),
    ),
    *(
        Setting(
            f"kv-{tier}-bytes",
            format_bytes(getattr(KVTierConfig, f"{tier}_bytes")),
            f"the {tier} tier's budget; least recently used blocks leave first",
            size,
            **_TIER,
        )
        for tier in ("host", "disk", "redis")
    ),
    Setting(
        "kv-write",
        KVTierConfig.write,
        "through: a prefix block goes down as it fills (found by other workers and after "
        "a restart); back: only when the pool evicts it",
        choices=KV_WRITE_POLICIES,
        **_TIER,
    ),
    Setting(
        "kv-load-min-tokens",
        KVTierConfig.load_min_tokens,
        "a tier hit shorter than this is recomputed instead of loaded",
        whole(0),
        **_TIER,
    ),
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
