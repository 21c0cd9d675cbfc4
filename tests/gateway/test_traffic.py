"""TrafficSplit: shares exact over any window, only ready versions, validated percents."""

from __future__ import annotations

from collections import Counter

import pytest

from services.gateway.mesh.traffic import TrafficSplit
from shared.errors import KvmeshError, Reason


def test_a_canary_gets_its_share_in_every_window() -> None:
    split = TrafficSplit()
    split.set("m", {"1": 90.0, "2": 10.0})
    chosen = [split.choose("m", {"1", "2"}) for _ in range(100)]
    for start in range(0, 100, 10):
        assert Counter(chosen[start : start + 10]) == {"1": 9, "2": 1}


def test_uneven_shares_stay_within_one_request() -> None:
    split = TrafficSplit()
    split.set("m", {"a": 25.0, "b": 75.0})
    chosen = [split.choose("m", {"a", "b"}) for _ in range(40)]
    for end in range(1, 41):
        assert abs(chosen[:end].count("a") - end * 0.25) <= 1


def test_only_ready_versions_and_no_split_means_none() -> None:
    split = TrafficSplit()
    assert split.choose("m", {"1"}) is None  # no split: every ready version serves
    split.set("m", {"1": 50.0, "2": 50.0})
    assert {split.choose("m", {"2"}) for _ in range(5)} == {"2"}  # 1 not ready: all to 2
    assert split.choose("m", {"3"}) is None
    split.set("m", {})
    assert split.percent("m") == {}


@pytest.mark.parametrize("percent", [{"1": 50.0}, {"1": 120.0, "2": -20.0}])
def test_percents_must_sum_to_100(percent: dict[str, float]) -> None:
    with pytest.raises(KvmeshError) as refused:
        TrafficSplit().set("m", percent)
    assert refused.value.reason is Reason.INVALID_ARGUMENT
