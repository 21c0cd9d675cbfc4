"""The KV tier flags: parsed into the worker's config, forwarded by a launcher unchanged, and
refused when they cannot work."""

from __future__ import annotations

import argparse

import pytest

from shared.config import KVTierConfig
from shared.errors import KvmeshError
from shared.flag_forwarding import worker_flag_args
from shared.flags import add_worker_flags, engine_config
from shared.model_entry import ServingConfig


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    return parser.parse_args(list(argv))


def test_flags_reach_the_config_and_a_launcher_forwards_them_unchanged() -> None:
    args = parsed(
        *("--kv-tiers", "disk,redis", "--kv-redis", "redis://r:6379/0"),
        *("--kv-disk-bytes", "1GiB", "--kv-write", "back", "--kv-load-min-tokens", "64"),
    )
    tiers = engine_config(args).kv_tiers
    assert tiers.tiers == ("disk", "redis") and tiers.write == "back"
    assert (tiers.disk_bytes, tiers.load_min_tokens) == (1 << 30, 64)
    assert tiers.redis_url == "redis://r:6379/0"
    assert engine_config(parsed(*worker_flag_args(args))).kv_tiers == tiers
    assert not engine_config(parsed()).kv_tiers.enabled  # off unless asked for


def test_a_repository_version_sets_its_tiers() -> None:
    serving = ServingConfig(kv_tiers="disk", kv_load_min_tokens=64)
    tiers = engine_config(parsed(*serving.worker_args())).kv_tiers
    assert (tiers.tiers, tiers.load_min_tokens) == (("disk",), 64)


def test_tiers_that_cannot_work_are_refused() -> None:
    with pytest.raises(KvmeshError, match="among"):
        KVTierConfig(tiers=("tape",))
    with pytest.raises(KvmeshError, match="Redis URL"):
        KVTierConfig(tiers=("redis",))
    with pytest.raises(SystemExit):
        parsed("--kv-write", "sometimes")
