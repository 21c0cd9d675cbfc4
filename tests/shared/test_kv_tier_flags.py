"""The KV tier flags: parsed into the worker's config, forwarded by a launcher unchanged, and
refused when they cannot work."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.cli import build_parser as kvmesh_parser
from kvmesh.mesh.settings import service_args, serving_args
from services.engine_worker.config import build_parser, engine_config
from shared.config import KVTierConfig
from shared.errors import KvmeshError
from shared.model_entry import ModelEntry, ServingConfig
from shared.runtime.settings import WORKER, SettingError


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_flags_reach_the_config_and_a_launcher_forwards_them_unchanged() -> None:
    argv = [
        *("--kv-tiers", "disk,redis", "--kv-redis", "redis://r:6379/0"),
        *("--kv-disk-bytes", "1GiB", "--kv-write", "back", "--kv-load-min-tokens", "64"),
    ]
    tiers = engine_config(parsed(*argv)).kv_tiers
    assert tiers.tiers == ("disk", "redis") and tiers.write == "back"
    assert (tiers.disk_bytes, tiers.load_min_tokens) == (1 << 30, 64)
    assert tiers.redis_url == "redis://r:6379/0"
    up = kvmesh_parser().parse_args(["up", *argv])
    assert engine_config(parsed(*service_args(up, WORKER))).kv_tiers == tiers
    assert not engine_config(parsed()).kv_tiers.enabled  # off unless asked for


def test_a_repository_version_sets_its_tiers() -> None:
    serving = ServingConfig(kv_tiers="disk", kv_load_min_tokens=64)
    entry = ModelEntry("m", "1", "/repo/m/1", "model.gguf", {}, serving)
    tiers = engine_config(parsed(*serving_args(entry, WORKER))).kv_tiers
    assert (tiers.tiers, tiers.load_min_tokens) == (("disk",), 64)


def test_tiers_that_cannot_work_are_refused() -> None:
    with pytest.raises(KvmeshError, match="among"):
        KVTierConfig(tiers=("tape",))
    with pytest.raises(KvmeshError, match="Redis URL"):
        KVTierConfig(tiers=("redis",))
    with pytest.raises(SettingError, match="argument --kv-write: invalid choice: 'sometimes'"):
        parsed("--kv-write", "sometimes")
    with pytest.raises(SettingError, match="argument --kv-tiers: 'tape' is not one of"):
        parsed("--kv-tiers", "disk,tape")
